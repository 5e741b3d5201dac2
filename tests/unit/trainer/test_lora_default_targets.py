"""The default ``--lora-target-modules`` (``all``, trainer/lora/settings.py ``family_targets``) on
every family: every attention projection the family has is adapted, not only ``o_proj`` (the
lists below are read off transformers' modeling files, not the code under test), the routed
experts' fused tensors too (gpt-oss's excepted), never the router or the indexer / compressor;
peft warns of nothing (no ``rank_pattern keys did not match``); the merged weights the push and
``--save-hf`` carry give the LoRA policy's own logits."""
from __future__ import annotations

import warnings

import pytest
import torch

from replayrl.rollout.model.families.base import FamilyModel
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.lora import peft_adapter as lora
from tests.backend_fixtures import lora_config, randomize_adapters, token_ids
from tests.family_checkpoints import ALL_FAMILIES, any_family_checkpoint

pytest.importorskip("transformers", reason="checkpoints are written by transformers")
pytest.importorskip("peft", reason="peft (the lora extra) is not installed")

_MLA = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
ATTENTION = {
    "deepseek_v32": _MLA, "glm_moe_dsa": _MLA, "glm4_moe_lite": _MLA, "deepseek_v3": _MLA, "kimi_k25": _MLA,
    "gpt_oss": {"q_proj", "k_proj", "v_proj", "o_proj"},
    # full attention layers, and the gated DeltaNet layers (linear_attn)
    "qwen3_5_moe": {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                    "in_proj_a", "out_proj"},
    # the attention's own; its compressors' and indexer's kv_proj / gate_proj / q_b_proj are not,
    # nor the grouped o_a_proj (applied per group, not as the nn.Linear it subclasses)
    "deepseek_v4": {"q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"},
}
"""Per family: the leaf names of the attention ``nn.Linear`` modules the default adapts."""
RANK = 4  # tests/backend_fixtures.py lora_config


def _attention_by_hand(model: torch.nn.Module, family: str) -> dict[str, int]:
    """Module name -> ``RANK x (in + out)`` of every attention ``nn.Linear`` of the plain model
    whose leaf name is in :data:`ATTENTION` (under ``self_attn`` / ``linear_attn``, outside the
    compressors and indexers)."""
    return {name: RANK * (m.in_features + m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ATTENTION[family]
            and (".self_attn." in name or ".linear_attn." in name)
            and ".compressor." not in name and ".indexer." not in name}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: any_family_checkpoint(f, root / f) for f in ALL_FAMILIES}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_default_targets_adapt_every_projection_of_the_family(checkpoints, family):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = TorchBackend(str(checkpoints[family]), lora_config(), [])
    assert not [str(w.message) for w in caught if "peft" in w.filename], family
    with torch.random.fork_rng(devices=[]):
        plain = FamilyModel.from_config(backend.model.config, torch.float32)
    want = _attention_by_hand(plain.hf, family)
    names = {n.rsplit(".", 1)[-1] for n in want}
    assert names == ATTENTION[family] and names - {"o_proj"}  # more than o_proj, all there
    adapted = dict(lora._lora_layers(backend.model))
    got = {name: sum(p.numel() for p in layer.lora_A.parameters()) + sum(p.numel() for p in layer.lora_B.parameters())
           for name, layer in adapted.items() if ".self_attn." in name or ".linear_attn." in name}
    assert got == want
    assert not any(".indexer." in n or ".compressor." in n or n.endswith(".gate") for n in adapted)
    experts = {n.rsplit(".", 1)[-1] for n in lora.adapted_weights(backend.model) if ".mlp.experts." in n}
    assert experts == (set() if family == "gpt_oss" else {"gate_up_proj", "down_proj"})
    # the merged weights (the push's factors, --save-hf) are the LoRA policy
    randomize_adapters(backend.model)
    plain.load_state_dict(lora.merged_state(backend.model))
    ids, _ = token_ids(97)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        own, merged = backend.model.eval()(ids, pos).logits, plain.eval()(ids, pos).logits
        base = plain.load_state_dict(lora.base_state(backend.model)) and plain(ids, pos).logits
    assert (base - own).abs().max() > 1e-3  # the adapters do something
    torch.testing.assert_close(merged, own, rtol=0, atol=1e-4)


def test_names_a_family_lacks_or_half_its_fused_experts_are_refused_before_start(checkpoints, tmp_path):
    small = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "lora-rank": 8, "output-dir": str(tmp_path)}
    glm5 = {**small, "hf-checkpoint": str(checkpoints["glm_moe_dsa"])}
    with pytest.raises(ConfigError, match=r"--lora-target-modules gate_proj,o_proj: the 'glm_moe_dsa' family's "
                                          r"experts hold gate_proj and up_proj as one tensor"):
        build_config({**glm5, "lora-target-modules": "gate_proj,o_proj"})
    with pytest.raises(ConfigError, match=r"--lora-target-modules in_proj_qkv: the 'glm_moe_dsa' policy has none"):
        build_config({**glm5, "lora-target-modules": "in_proj_qkv"})
    qwen35 = {**small, "hf-checkpoint": str(checkpoints["qwen3_5_moe"]), "lora-target-modules": "in_proj_qkv"}
    assert build_config(qwen35).trainer.lora_target_modules == "in_proj_qkv"
    assert build_config(glm5).trainer.lora_target_modules == "all"
