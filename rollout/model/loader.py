"""Loading Hugging Face checkpoint directories into the model, tensor by tensor.

Reads what transformers' `save_pretrained` writes for `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`
(and what `replayrl.rollout.model.checkpoint.save_pretrained` writes): `config.json` plus either one
`model.safetensors` or shards listed in `model.safetensors.index.json`, in any stored floating
dtype. The model is built on the meta device, allocated once in the target dtype, and each
tensor is read from its shard (`safetensors.safe_open`, memory-mapped) and copied into its
parameter, so a load holds the model plus one tensor, never a second copy of the weights
(docs/design/model.md#hf-checkpoints).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.errors import CheckpointError
from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.model.weight_files import INDEX_NAME, WEIGHTS_NAME, _weight_files, check_weight_files  # noqa: F401  (re-exported)

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def load_pretrained(directory: str | Path, dtype: torch.dtype = torch.float32
                    ) -> tuple[Qwen3MoeForCausalLM, ModelConfig]:
    """Load a Hugging Face checkpoint directory; returns (model in `dtype`, config). A family
    checkpoint (rollout/model/families/) loads through transformers into a `FamilyModel`.

    Peak memory is the model in `dtype` plus the largest tensor (and the pages of the shard
    being read): the model is built on the meta device and allocated once, then filled tensor
    by tensor. Stored float64 / float32 / float16 / bfloat16 tensors are cast to `dtype`.

    Raises `CheckpointError` for a missing file, a missing / unexpected / repeated weight
    (named), a shape mismatch (name, expected and found shape), a non-floating tensor, or a
    stored `lm_head.weight` that differs from the embedding of a tied model;
    `ModelConfigError` for an unusable config.json.
    """
    cfg = read_hf_config(directory)
    if not isinstance(cfg, ModelConfig):  # a family: transformers reads its shards
        from replayrl.rollout.model.families.base import FamilyModel

        check_weight_files(directory)
        return FamilyModel.from_pretrained(directory, cfg, dtype), cfg
    model = Qwen3MoeForCausalLM.empty(cfg, dtype)
    load_weights_into(model, directory)
    return model, cfg


def load_weights_into(model: Qwen3MoeForCausalLM, directory: str | Path) -> None:
    """Copy a checkpoint directory's weights into `model` in place, tensor by tensor.

    The directory's config.json must describe `model.config` (checked first). Used to build a
    model (`load_pretrained`) and to restore a trainer's weights at resume without a second
    model. Raises as `load_pretrained`; on an error the model may be partly overwritten.
    """
    src = Path(directory)
    cfg = read_hf_config(src)
    if cfg != model.config:
        raise CheckpointError(f"{src / 'config.json'} describes another model than the one "
                              f"being loaded into")
    if not isinstance(cfg, ModelConfig):  # a family model: load it, then copy in place
        fresh, _ = load_pretrained(src, model.dtype)
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(fresh.state_dict()[name])
        return
    params = model.state_dict()
    tied = cfg.tie_word_embeddings
    loaded: dict[str, Path] = {}
    for path, names in _weight_files(src):
        try:
            with safe_open(str(path), framework="pt") as f:
                stored = set(f.keys())
                for name in (names if names is not None else sorted(stored)):
                    if name not in stored:
                        raise CheckpointError(f"{src / INDEX_NAME} maps {name!r} to {path.name}, "
                                              f"which does not hold it")
                    _copy_one(f, name, path, params, loaded, tied)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    needed = set(params) - ({"lm_head.weight"} if tied else set())
    missing = sorted(needed - set(loaded))
    if missing:
        raise CheckpointError(f"{src}: missing key {missing[0]!r} ({len(missing)} missing)")
    if tied and "lm_head.weight" in loaded:
        _check_tied_head(loaded["lm_head.weight"], params["model.embed_tokens.weight"])


def _copy_one(f, name: str, path: Path, params: dict[str, torch.Tensor],
              loaded: dict[str, Path], tied: bool) -> None:
    """Check one stored tensor's name, dtype and shape, then copy it into its parameter."""
    if name not in params:
        raise CheckpointError(f"{path}: unexpected key {name!r} (the model has no such weight)")
    if name in loaded:
        raise CheckpointError(f"{path}: key {name!r} is stored twice (also in {loaded[name].name})")
    sl = f.get_slice(name)
    if sl.get_dtype() not in _FLOAT_DTYPES:
        raise CheckpointError(f"{path}: {name!r} is stored as {sl.get_dtype()}, not a floating dtype")
    shape, want = list(sl.get_shape()), list(params[name].shape)
    if shape != want:
        raise CheckpointError(f"{path}: shape mismatch for {name!r}: model {want}, found {shape}")
    loaded[name] = path
    if tied and name == "lm_head.weight":
        return  # the head is the embedding; checked against it once that is loaded
    with torch.no_grad():
        params[name].copy_(f.get_tensor(name))


def _check_tied_head(path: Path, embedding: torch.Tensor) -> None:
    with safe_open(str(path), framework="pt") as f:
        head = f.get_tensor("lm_head.weight").to(embedding.dtype)
    if not torch.equal(head, embedding):
        raise CheckpointError(f"{path}: 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                              f"but config.json field 'tie_word_embeddings'=true ties them")
