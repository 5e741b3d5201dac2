"""Writing Hugging Face checkpoint directories, and weight pushes, for the model.

A directory written by `save_pretrained` loads in transformers (`Qwen3MoeForCausalLM`, or
`Qwen3ForCausalLM` for a model without experts; `AutoTokenizer`), vLLM and SGLang: config.json,
model.safetensors with HF parameter names (one tensor per expert,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, as Qwen3-MoE checkpoints on the Hub; no
`lm_head.weight` when it is tied to the embedding, as transformers writes it),
generation_config.json, and the tokenizer: a word-level one built from a vocabulary, or the
files of the checkpoint the run started from, copied unchanged. Indexer weights
(`self_attn.indexer.*`) are stored too; transformers ignores them with a warning, and an engine
without the indexer computes dense attention on those layers, i.e. another model.
Reading is `replayrl.rollout.model.loader`.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.errors import CheckpointError
from replayrl.rollout.model.families.base import FamilyModel
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.model.word_tokenizer import SPECIAL_TOKENS, save_word_tokenizer
from replayrl.rollout.model.word_tokenizer import write_json as _write_json
from replayrl.transport.shm_pool import read_once

WEIGHTS_NAME = "model.safetensors"
# tokenizer and generation files a checkpoint directory may carry; copied as they are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_ARRAY_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64))


def save_pretrained(model: Qwen3MoeForCausalLM, directory: str | Path,
                    tokens: list[str] | None = None, tokenizer_from: str | Path | None = None
                    ) -> Path:
    """Write `model` and a tokenizer as a Hugging Face checkpoint directory.

    Exactly one of:
    tokens: the whole vocabulary in id order (token id = list index); must hold `<pad>`, `<bos>`
        and `<eos>`, no duplicates, no whitespace inside a token, and exactly
        `config.vocab_size` entries. A word-level tokenizer over it is written: text is split on
        whitespace and every word must be in the vocabulary (no unknown token).
    tokenizer_from: a checkpoint directory (the one the run started from) whose tokenizer and
        generation files (`TOKENIZER_FILES`, those present) are copied unchanged, with the
        bos / eos / pad ids of its config.json.
    Weights are stored in the model's dtype; a tied LM head is not stored (transformers ties it
    on load). Creates `directory` if needed and returns its path.
    Raises `CheckpointError` for a bad vocabulary, an unreadable `tokenizer_from` config.json,
    both or neither tokenizer source, or an unsupported dtype.
    """
    cfg = model.config
    if (tokens is None) == (tokenizer_from is None):
        raise CheckpointError("save_pretrained needs exactly one of tokens / tokenizer_from")
    if tokens is not None:
        _check_vocab(tokens, cfg)
        ids = {name: tokens.index(name) for name in SPECIAL_TOKENS}
        special = {"bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"],
                   "pad_token_id": ids["<pad>"]}
    else:
        src = Path(tokenizer_from)
        try:
            source = json.loads((src / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot read {src / 'config.json'}: {exc}") from exc
        special = {k: source[k] for k in _TOKEN_ID_KEYS if k in source}
    out = _save_model(model, directory, special)
    if tokens is not None:
        _write_json(out / "generation_config.json", special)
        save_word_tokenizer(out, tokens, cfg.max_position_embeddings)
    else:
        for name in TOKENIZER_FILES:
            if (src / name).is_file() and src.resolve() != out.resolve():
                shutil.copyfile(src / name, out / name)
    return out


def save_model_files(model: Qwen3MoeForCausalLM, directory: str | Path) -> Path:
    """Write only config.json and model.safetensors of `model` (no tokenizer, no special ids).

    What an engine that takes token ids and never detokenizes needs to build the model (vLLM
    with `skip_tokenizer_init`); its real weights arrive by weight push. Creates `directory` if
    needed and returns its path. Raises `CheckpointError` for an unsupported dtype.
    """
    return _save_model(model, directory, {})


def _save_model(model: Qwen3MoeForCausalLM, directory: str | Path, special: dict) -> Path:
    """config.json (with the `special` token ids) and model.safetensors; a tied LM head is not
    stored (transformers ties it on load)."""
    cfg = model.config
    if model.dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"cannot store weights of dtype {model.dtype}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, FamilyModel):  # rollout/model/families/: transformers writes it
        model.hf.save_pretrained(out)
        hf = json.loads((out / "config.json").read_text())
        hf.update(special)
        _write_json(out / "config.json", hf)
        return out
    hf = cfg.to_hf_dict(torch_dtype=_DTYPE_NAMES[model.dtype])
    hf.update(special)
    _write_json(out / "config.json", hf)
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()
               if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def state_dict_arrays(model: Qwen3MoeForCausalLM) -> dict[str, np.ndarray]:
    """All weights as read-only float32 numpy arrays keyed by HF name, for a weight push.

    numpy has no bfloat16, so a bf16 model's weights are widened to float32 (exact); an fp32
    model's are copied, so the arrays stay valid while the trainer keeps updating its weights.
    """
    out = {}
    for name, t in model.state_dict().items():
        a = t.detach().to(device="cpu", dtype=torch.float32, copy=True).numpy()
        a.setflags(write=False)
        out[name] = a
    return out


def load_state_arrays(model: Qwen3MoeForCausalLM, arrays: dict[str, np.ndarray]) -> None:
    """Copy a weight push (`state_dict_arrays` output) into `model` in place, casting to its dtype.

    Arrays must be float32 / float16 / float64 numpy arrays with exactly the model's keys and
    shapes. Checks everything before copying anything, so a bad push leaves the model unchanged.
    Raises `CheckpointError` naming the missing / unexpected key, the shape mismatch or the dtype.
    """
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray) or a.dtype not in _ARRAY_DTYPES:
            raise CheckpointError(f"weight push: {name!r} must be a float32/float16/float64 numpy array, got "
                                  f"{getattr(a, 'dtype', type(a).__name__)}")
    _copy_into(model, arrays, source="weight push")


def _copy_into(model: Qwen3MoeForCausalLM, tensors: dict[str, torch.Tensor | np.ndarray],
               source: str) -> None:
    """Check key set and shapes of `tensors` against `model`, then copy them in (no_grad)."""
    params = model.state_dict()
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing:
        raise CheckpointError(f"{source}: missing key {missing[0]!r} ({len(missing)} missing)")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected key {unexpected[0]!r} ({len(unexpected)} unexpected)")
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise CheckpointError(f"{source}: shape mismatch for {name!r}: model {list(p.shape)}, "
                                  f"found {list(tensors[name].shape)}")
    with torch.no_grad(), warnings.catch_warnings():
        # Pushed arrays are read-only; torch warns on wrapping them although we only read them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, p in params.items():
            t = tensors[name]
            if isinstance(t, np.ndarray):
                # a push received in shared memory: this array's pages are mapped for its copy
                # only, so the engine never holds the whole push beside its own weights
                with read_once(t):
                    p.copy_(torch.from_numpy(t))
            else:
                p.copy_(t)


def _check_vocab(tokens: list[str], cfg: ModelConfig) -> None:
    if len(tokens) != cfg.vocab_size:
        raise CheckpointError(f"tokens has {len(tokens)} entries, config.vocab_size is {cfg.vocab_size}")
    if len(set(tokens)) != len(tokens):
        dup = next(t for t in tokens if tokens.count(t) > 1)
        raise CheckpointError(f"tokens repeats {dup!r}")
    for name in SPECIAL_TOKENS:
        if name not in tokens:
            raise CheckpointError(f"tokens lacks the special token {name!r}")
    for t in tokens:
        if not t or any(c.isspace() for c in t):
            raise CheckpointError(f"token {t!r} is empty or holds whitespace (the tokenizer splits on it)")
