"""Which transformers class reads a checkpoint's tokenizer, resolved once, so that processes
without torch can load the same tokenizer (a torch runtime is ~200 MiB RSS:
VmRSS after ``import torch``, torch 2.13 CPU).

``transformers.AutoTokenizer`` picks the class from ``tokenizer_config.json`` and the
checkpoint's ``config.json``; in transformers 5 its import chain loads torch whenever torch is
installed. The class it picks (for the checkpoints replayrl writes and most fast tokenizers,
``TokenizersBackend``, alias ``PreTrainedTokenizerFast``) usually imports without torch.
:func:`resolve_tokenizer_class` runs ``AutoTokenizer`` once in a process that has torch anyway
(the launcher's initial-files child) and names that class when loading the directory with it
directly gives the same tokenizer (:func:`resolve_tokenizer` also returns that load, which the child's prompt
check reuses); :func:`load_tokenizer_object` then loads with that class in the rollout manager,
and with ``AutoTokenizer`` when the class is ``AUTO`` (remote code, or a class whose direct
load differs). A tokenizer transformers only wraps (no chat template: the embedded one) resolves
to :class:`replayrl.rollout.text.backend_tokenizer.BackendTokenizer`, which reads it with the
``tokenizers`` library and imports no transformers at all.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from replayrl.rollout.text.backend_tokenizer import BACKEND_CLASS, BackendTokenizer, same_tokenizer

AUTO = "auto"
"""The class path that means: resolve with ``AutoTokenizer`` in this process."""


def class_path(cls: type) -> str:
    """``"module:QualName"`` of a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _fingerprint(tokenizer: Any) -> dict:
    """What two loads of one directory must share to be the same tokenizer: class, the
    ``tokenizers`` model / normaliser / pre-tokeniser / decoder and added tokens (``to_str``),
    special tokens, chat template and the encoding settings."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return {
        "class": class_path(type(tokenizer)),
        "backend": backend.to_str() if backend is not None else None,
        "vocab": None if backend is not None else tokenizer.get_vocab(),
        "added": {i: str(t) for i, t in tokenizer.added_tokens_decoder.items()},
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "special_ids": list(tokenizer.all_special_ids),
        "chat_template": tokenizer.chat_template,
        "settings": [getattr(tokenizer, k, None) for k in (
            "padding_side", "truncation_side", "model_max_length", "clean_up_tokenization_spaces",
            "add_bos_token", "add_eos_token", "bos_token_id", "eos_token_id", "pad_token_id")],
    }


def resolve_tokenizer_class(directory: str | Path) -> str:
    """The class that loads ``directory``'s tokenizer as ``AutoTokenizer`` does, as
    ``"module:QualName"``, or :data:`AUTO` when only ``AutoTokenizer`` will do (``auto_map``
    remote code, or the class's own ``from_pretrained`` gives another tokenizer); a tokenizer
    transformers only wraps resolves to
    :data:`replayrl.rollout.text.backend_tokenizer.BACKEND_CLASS` (``tokenizers`` alone). Imports torch
    (through ``AutoTokenizer``); call it where torch is loaded anyway.

    Raises:
        whatever ``AutoTokenizer.from_pretrained`` raises for an unloadable directory.
    """
    return resolve_tokenizer(directory)[0]


def resolve_tokenizer(directory: str | Path) -> tuple[str, Any]:
    """:func:`resolve_tokenizer_class` and the tokenizer object it loaded that
    :func:`load_tokenizer_object` of that class would give (the direct load, or
    ``AutoTokenizer``'s for :data:`AUTO`); None when nothing was loaded (``auto_map``).

    Raises:
        as :func:`resolve_tokenizer_class`.
    """
    from transformers import AutoTokenizer

    path = Path(directory)
    config_file = path / "tokenizer_config.json"
    try:
        if "auto_map" in json.loads(config_file.read_text()):
            return AUTO, None
    except (OSError, ValueError):
        pass  # no (readable) tokenizer_config.json: AutoTokenizer decides below
    auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    cls = type(auto)
    try:
        light = BackendTokenizer.from_pretrained(path)
    except Exception:  # tokenizers alone cannot read it: a transformers class below
        light = None
    if light is not None and same_tokenizer(light, auto):
        return BACKEND_CLASS, light
    try:
        direct = cls.from_pretrained(str(path), local_files_only=True)
    except Exception:  # the class cannot load the directory alone: keep AutoTokenizer
        return AUTO, auto
    return (class_path(cls), direct) if _fingerprint(direct) == _fingerprint(auto) else (AUTO, auto)


def load_tokenizer_object(directory: str | Path, tokenizer_class: str | None = None) -> Any:
    """The transformers tokenizer of ``directory``: ``tokenizer_class`` (``"module:QualName"``,
    from :func:`resolve_tokenizer_class`) ``.from_pretrained``, or ``AutoTokenizer`` when it is
    None or :data:`AUTO`. Nothing is downloaded.

    Raises:
        whatever the class import or ``from_pretrained`` raises (the caller wraps it).
    """
    if tokenizer_class and tokenizer_class != AUTO:
        module, _, name = tokenizer_class.partition(":")
        cls = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
    else:
        from transformers import AutoTokenizer as cls  # imports torch when it is installed
    return cls.from_pretrained(str(directory), local_files_only=True)
