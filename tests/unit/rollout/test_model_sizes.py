"""The embedded model's size presets (``--model-size``): parameter counts by hand and by
transformers' model loaded from the checkpoint the run writes, and the run-config wiring."""

import pytest
import torch

from replayrl.rollout.model.config import MODEL_SIZES, default_config, embedded_config
from replayrl.rollout.model.errors import ModelConfigError
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint

V = len(VOCABULARY)

# (hidden, layers, dense intermediate, experts, expert width, heads, kv heads, head_dim,
#  indexer layers, indexer heads, indexer head_dim), written out from the brief's presets
SHAPES = {"1m": (128, 4, 256, 8, 64, 4, 2, 32, 2, 2, 16),
          "10m": (256, 6, 1024, 8, 256, 8, 4, 32, 3, 2, 16),
          "50m": (512, 7, 2048, 8, 512, 8, 4, 64, 3, 4, 32)}


def hand_count(h, layers, inter, experts, width, heads, kv, hd, idx_layers, idx_heads, idx_hd,
               indexer=True):
    """Parameters of a Qwen3-MoE with layer 0 dense and the rest MoE, untied head."""
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q k v o + q/k norms
    norms = 2 * h
    dense = 3 * h * inter
    moe = h * experts + experts * 3 * h * width  # router + experts
    total = 2 * V * h + h + layers * (attention + norms) + dense + (layers - 1) * moe
    if indexer:  # wq, wk, weights_proj per indexed layer
        total += idx_layers * (h * idx_heads * idx_hd + h * idx_hd + h * idx_heads)
    return total


def _ours(cfg):
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3MoeForCausalLM(cfg).parameters())


@pytest.mark.parametrize("size", MODEL_SIZES)
def test_preset_parameter_count_matches_the_hand_count(size):
    assert _ours(embedded_config(V, size)) == hand_count(*SHAPES[size])


def test_presets_are_about_1m_10m_50m_and_1m_is_the_default_model():
    counts = {s: hand_count(*SHAPES[s]) for s in MODEL_SIZES}
    assert 0.8e6 < counts["1m"] < 1.2e6 and 8e6 < counts["10m"] < 12e6 and 40e6 < counts["50m"] < 60e6
    assert embedded_config(V, "1m") == default_config(V)
    assert build_config({}).policy_config == default_config(V)


@pytest.mark.parametrize("size", ["10m", "50m"])
def test_transformers_builds_the_same_model_from_the_written_config(size):
    """transformers' Qwen3MoeForCausalLM built from our config.json has our parameters minus the
    indexer's (it has no indexer)."""
    transformers = pytest.importorskip("transformers")
    cfg = embedded_config(V, size)
    hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                                           if k not in ("architectures", "replayrl_indexer")})
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_cfg)
    assert sum(p.numel() for p in hf.parameters()) == hand_count(*SHAPES[size], indexer=False)


def test_the_run_writes_a_10m_checkpoint_transformers_loads_with_our_logits(tmp_path):
    """The run's checkpoint-init at --model-size 10m: transformers loads every weight (indexer
    aside) and, on a prompt no longer than the indexer's top-k (so it keeps every key), gives
    our model's logits."""
    transformers = pytest.importorskip("transformers")
    from replayrl.rollout.model.loader import load_pretrained

    config = build_config({"model-size": "10m", "seed": 3})
    path = write_initial_checkpoint(config, tmp_path / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert sum(p.numel() for p in hf.parameters()) == hand_count(*SHAPES["10m"], indexer=False)
    ours, _ = load_pretrained(path)
    ids = torch.tensor([[1, 5, 9, 12, 7, 30, 2, 4]])
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids, torch.arange(ids.shape[1])[None]).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_positions_grow_for_long_answers_only():
    assert embedded_config(V, "10m", min_positions=100).max_position_embeddings == 256
    assert embedded_config(V, "10m", min_positions=300).max_position_embeddings == 300
    config = build_config({"rollout-max-response-len": 300})
    assert config.policy_config.max_position_embeddings == 4 + 3 + 300 + 2


def test_bad_size_and_size_with_a_checkpoint_are_refused(tmp_path):
    with pytest.raises(ModelConfigError, match="model size must be one of 1m, 10m, 50m, got '2m'"):
        embedded_config(V, "2m")
    with pytest.raises(ConfigError, match="model-size"):
        build_config({"model-size": "2m"})
    path = write_initial_checkpoint(build_config({}), tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="--model-size 10m shapes the embedded model"):
        build_config({"model-size": "10m", "hf-checkpoint": str(path)})
