"""A checkpoint's tokenizer through the ``tokenizers`` library alone, for a tokenizer that
transformers would only wrap (``import transformers`` and its tokenizer are ~30 MiB RSS in the
launcher, which serves the rollout manager).

transformers' fast tokenizer class (``TokenizersBackend`` in transformers 5, alias
``PreTrainedTokenizerFast``) encodes with its ``tokenizers.Tokenizer`` (``encode_batch(...,
add_special_tokens=...)``) and decodes with it (``decode(ids, skip_special_tokens)``, then a
space clean-up when ``clean_up_tokenization_spaces`` is set). For a directory that loads as that
exact class, without a chat template, with ``clean_up_tokenization_spaces`` and
``split_special_tokens`` off, and whose ``tokenizer.json`` read by ``tokenizers`` serialises to
the same tokenizer as the one transformers built from it (added tokens and post-processor
included), :class:`BackendTokenizer` gives the same ids and text. Whether a directory qualifies
is decided once, in a process that loaded transformers anyway
(:func:`replayrl.rollout.text.tokenizer_class.resolve_tokenizer`, with :func:`same_tokenizer`); the
rollout manager then reads it with :class:`BackendTokenizer`. Anything else a task or reward asks
of it (``convert_ids_to_tokens``, ``batch_decode``, other arguments, ``add_tokens`` ...) loads
transformers' class, which from then on answers every call.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BACKEND_CLASS = "replayrl.rollout.text.backend_tokenizer:BackendTokenizer"
"""The class path :func:`replayrl.rollout.text.tokenizer_class.load_tokenizer_object` loads it with."""

WRAPPER_CLASSES = ("transformers.tokenization_utils_tokenizers:TokenizersBackend",
                   "transformers.tokenization_utils_fast:PreTrainedTokenizerFast")
"""transformers' classes that only wrap a ``tokenizers.Tokenizer`` (5.x, 4.x)."""


def _config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class BackendTokenizer:
    """The calls replayrl's rollout side makes of transformers' fast tokenizer, served by a
    ``tokenizers.Tokenizer``: ``tokenizer(text, add_special_tokens=...)["input_ids"]`` of one
    text, ``decode(ids, skip_special_tokens=...)`` of one id list, ``get_vocab()``, ``len()``,
    ``eos_token_id``. Anything else (another attribute or method, other arguments to those
    calls, setting an attribute) loads transformers' class for the directory, and from then on
    *every* call goes to it, so a reward that changes the tokenizer (``add_tokens``, setting
    ``pad_token``) sees one consistent tokenizer.

    Attributes:
        backend: the ``tokenizers.Tokenizer`` (truncation and padding off).
        directory: the checkpoint directory it was read from.
        chat_template: None (a directory with a template is read by transformers).
    """

    _OWN = frozenset({"backend", "directory", "_eos_token_id", "_transformers"})

    def __init__(self, backend: Any, directory: Path, eos_token_id: int | None) -> None:
        self.backend = backend
        self.directory = directory
        self._eos_token_id = eos_token_id
        self._transformers: Any = None

    @classmethod
    def from_pretrained(cls, directory: str | Path, local_files_only: bool = True) -> "BackendTokenizer":
        """Read ``directory/tokenizer.json`` (and the ``eos_token`` of ``tokenizer_config.json``);
        nothing is downloaded (``local_files_only`` is accepted for the transformers signature).

        Raises:
            OSError: no ``tokenizer.json``; ValueError / Exception: ``tokenizers`` cannot read it
            (the caller, :func:`replayrl.rollout.text.tokenizer.load_tokenizer`, names the directory).
        """
        from tokenizers import Tokenizer

        path = Path(directory)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise OSError(f"{file}: no such file")
        backend = Tokenizer.from_file(str(file))
        backend.no_truncation()
        backend.no_padding()
        eos = _token_text(_config(path).get("eos_token"))
        return cls(backend, path, backend.token_to_id(eos) if eos is not None else None)

    def transformers_tokenizer(self) -> Any:
        """transformers' ``PreTrainedTokenizerFast`` of the directory, loaded on the first call;
        after it every call of this object goes to it."""
        if self._transformers is None:
            from transformers import PreTrainedTokenizerFast

            object.__setattr__(self, "_transformers", PreTrainedTokenizerFast.from_pretrained(
                str(self.directory), local_files_only=True))
        return self._transformers

    @property
    def chat_template(self) -> Any:
        """None, or transformers' once it is loaded."""
        return None if self._transformers is None else self._transformers.chat_template

    @property
    def eos_token_id(self) -> int | None:
        """The id of ``tokenizer_config.json``'s ``eos_token`` (None without one)."""
        return self._eos_token_id if self._transformers is None else self._transformers.eos_token_id

    def __call__(self, text: Any, *args: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """``{"input_ids": ids}`` of one text, as transformers' ``tokenizer(text)["input_ids"]``;
        any other input or argument: transformers' own call."""
        if self._transformers is not None or args or kwargs or not isinstance(text, str):
            return self.transformers_tokenizer()(text, *args, add_special_tokens=add_special_tokens,
                                                 **kwargs)
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """The text of a list of int ids, as transformers' ``decode``; any other input or
        argument: transformers' own ``decode``."""
        if (self._transformers is not None or kwargs or not isinstance(ids, (list, tuple))
                or not all(isinstance(i, int) for i in ids)):
            return self.transformers_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens,
                                                        **kwargs)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        if self._transformers is not None:
            return self._transformers.get_vocab()
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        if self._transformers is not None:
            return len(self._transformers)
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes this class lacks: transformers' own tokenizer answers
        if name.startswith("__") or name in self._OWN:
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # a change of the tokenizer (pad_token ...): transformers' from now on
            setattr(self.transformers_tokenizer(), name, value)


_IDENTITY_SINGLE = [{"Sequence": {"id": "A", "type_id": 0}}]


def _serialised(backend: Any) -> dict:
    """A ``tokenizers.Tokenizer`` as JSON, without its truncation and padding (transformers sets
    those per call) and with a post-processor that adds nothing to one sequence written as none:
    transformers 5 installs ``TemplateProcessing(single="$A")`` on load when ``add_bos_token`` /
    ``add_eos_token`` are off, where the file has none; replayrl encodes single sequences only."""
    out = json.loads(backend.to_str())
    out["truncation"] = out["padding"] = None
    post = out.get("post_processor")
    if (isinstance(post, dict) and post.get("type") == "TemplateProcessing"
            and post.get("single") == _IDENTITY_SINGLE and not post.get("special_tokens")):
        out["post_processor"] = None
    return out


def same_tokenizer(light: BackendTokenizer, reference: Any) -> bool:
    """Whether ``light`` encodes and decodes as ``reference``, a transformers tokenizer of the
    same directory: ``reference`` is exactly one of :data:`WRAPPER_CLASSES`, has no chat
    template, ``clean_up_tokenization_spaces`` and ``split_special_tokens`` off, the same EOS
    id, and its ``tokenizers.Tokenizer`` serialises as ``light``'s."""
    cls = type(reference)
    if f"{cls.__module__}:{cls.__qualname__}" not in WRAPPER_CLASSES:
        return False
    if (reference.chat_template or getattr(reference, "clean_up_tokenization_spaces", False)
            or getattr(reference, "split_special_tokens", False)):
        return False
    return (reference.eos_token_id == light.eos_token_id
            and _serialised(reference.backend_tokenizer) == _serialised(light.backend))
