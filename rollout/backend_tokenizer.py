"""A checkpoint's tokenizer through the ``tokenizers`` library alone, for a tokenizer that
transformers would only wrap (issue 24, memory: ``import transformers`` and its tokenizer are
~30 MiB RSS in the launcher, which serves the rollout manager).

transformers' fast tokenizer class (``TokenizersBackend`` in transformers 5, alias
``PreTrainedTokenizerFast``) encodes with its ``tokenizers.Tokenizer`` (``encode_batch(...,
add_special_tokens=...)``) and decodes with it (``decode(ids, skip_special_tokens)``, then a
space clean-up when ``clean_up_tokenization_spaces`` is set). For a directory that loads as that
exact class, without a chat template, with ``clean_up_tokenization_spaces`` and
``split_special_tokens`` off, and whose ``tokenizer.json`` read by ``tokenizers`` serialises to
the same tokenizer as the one transformers built from it (added tokens and post-processor
included), :class:`BackendTokenizer` gives the same ids and text. Whether a directory qualifies
is decided once, in a process that loaded transformers anyway
(:func:`replayrl.rollout.tokenizer_class.resolve_tokenizer`, with :func:`same_tokenizer`); the
rollout manager then reads it with :class:`BackendTokenizer`. Anything else a task or reward asks
of it (``convert_ids_to_tokens``, ``batch_decode`` ...) loads transformers' class on first use and
is answered there, so user code sees the transformers API.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

BACKEND_CLASS = "replayrl.rollout.backend_tokenizer:BackendTokenizer"
"""The class path :func:`replayrl.rollout.tokenizer_class.load_tokenizer_object` loads it with."""

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
    """The subset of transformers' fast-tokenizer API replayrl's rollout side uses, served by a
    ``tokenizers.Tokenizer``; every other attribute comes from transformers' class, loaded on
    first use.

    Attributes:
        backend: the ``tokenizers.Tokenizer`` (truncation and padding off).
        directory: the checkpoint directory it was read from.
        eos_token_id: the id of ``tokenizer_config.json``'s ``eos_token``, or None.
        chat_template: always None (a directory with a template is read by transformers).
    """

    chat_template = None

    def __init__(self, backend: Any, directory: Path, eos_token_id: int | None) -> None:
        self.backend = backend
        self.directory = directory
        self.eos_token_id = eos_token_id
        self._transformers: Any = None

    @classmethod
    def from_pretrained(cls, directory: str | Path, local_files_only: bool = True) -> "BackendTokenizer":
        """Read ``directory/tokenizer.json`` (and the ``eos_token`` of ``tokenizer_config.json``);
        nothing is downloaded (``local_files_only`` is accepted for the transformers signature).

        Raises:
            OSError: no ``tokenizer.json``; ValueError / Exception: ``tokenizers`` cannot read it
            (the caller, :func:`replayrl.rollout.tokenizer.load_tokenizer`, names the directory).
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

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """``{"input_ids": ids}`` of one text, as transformers' ``tokenizer(text)["input_ids"]``.

        Raises:
            TypeError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"BackendTokenizer encodes one str, got {type(text).__name__}")
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (a list of ints), as transformers' ``decode``."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes this class lacks: transformers' own tokenizer answers
        if name.startswith("__") or name == "_transformers":
            raise AttributeError(name)
        if self._transformers is None:
            from transformers import PreTrainedTokenizerFast

            self._transformers = PreTrainedTokenizerFast.from_pretrained(str(self.directory),
                                                                         local_files_only=True)
        return getattr(self._transformers, name)


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
