"""--hf-checkpoint / --save-hf through the run: config checks, the embedded default as a
checkpoint, and a short real multi-process run from a transformers-written checkpoint whose
--save-hf output transformers loads."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from replayrl.rollout.model import Qwen3MoeForCausalLM, default_config
from replayrl.rollout.model.loader import load_pretrained
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config, config_from_args
from replayrl.tools.run.launcher import engine_kwargs, launch, write_initial_checkpoint

transformers = pytest.importorskip("transformers", reason="checkpoints are written by transformers")

SMALL = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "progress": False}


EXTENDED_VOCAB = len(VOCABULARY) + 5


def _hf_checkpoint(path, vocab_size=EXTENDED_VOCAB, **extra):
    """A tiny random dense Qwen3 written by transformers (no indexer block)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=64, tie_word_embeddings=True, **extra)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.mark.parametrize("seed", [1, 7])
def test_embedded_default_loaded_from_its_checkpoint_is_bit_identical(tmp_path, seed):
    config = build_config({"seed": seed, "output-dir": str(tmp_path)})
    direct = Qwen3MoeForCausalLM(default_config(vocab_size=len(VOCABULARY)))
    direct.init_weights(seed)  # how the initial policy was built before it became a checkpoint
    loaded, cfg = load_pretrained(write_initial_checkpoint(config, tmp_path / "init"))
    assert cfg == default_config(vocab_size=len(VOCABULARY)) == config.policy_config
    assert list(loaded.state_dict()) == list(direct.state_dict())
    for name, t in direct.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids, pos = torch.tensor([[1, 4, 5, 6, 7]]), torch.arange(5)[None]
    with torch.no_grad():
        assert torch.equal(loaded(ids, pos).logits, direct(ids, pos).logits)


def test_hf_checkpoint_config_reaches_engines_and_turns_indexer_replay_off(tmp_path):
    ckpt = _hf_checkpoint(tmp_path / "ckpt")
    config = build_config({"hf-checkpoint": str(ckpt)})
    assert config.policy_config.vocab_size == len(VOCABULARY) + 5
    assert engine_kwargs(config)["model_config"]["num_experts"] == 0
    assert config.trainer.use_indexer_replay is False  # not applicable: no indexer block
    assert build_config({}).trainer.use_indexer_replay is True  # the embedded default has one
    with pytest.raises(ConfigError, match="--use-indexer-replay: --hf-checkpoint .* has no indexer"):
        build_config({"hf-checkpoint": str(ckpt), "use-indexer-replay": True})
    # the run's record reads back (the resolved off is a plain --no-use-indexer-replay)
    record = tmp_path / "config.json"
    record.write_text(config.to_json())
    assert config_from_args(argparse.Namespace(config=record)) == config


@pytest.mark.parametrize("make, message", [
    (lambda p: _hf_checkpoint(p, vocab_size=len(VOCABULARY) - 1),
     rf"config.json field 'vocab_size'={len(VOCABULARY) - 1} is smaller than the "
     rf"{len(VOCABULARY)} token ids"),
    (lambda p: _hf_checkpoint(p, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     r"--hf-checkpoint .*'rope_scaling.rope_type'='dynamic' is not supported"),
    (lambda p: p, r"--hf-checkpoint .*cannot read .*config.json"),
])
def test_unusable_hf_checkpoint_is_a_config_error(tmp_path, make, message):
    ckpt = make(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=message):
        build_config({"hf-checkpoint": str(ckpt)})


def test_a_smaller_vocabulary_is_fine_with_own_prompt_data(tmp_path):
    # the embedded task's 44 ids matter only when its prompts are used
    ckpt = _hf_checkpoint(tmp_path / "ckpt", vocab_size=len(VOCABULARY) - 4)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "label": "b"}\n')
    config = build_config({"hf-checkpoint": str(ckpt), "prompt-data": str(prompts)})
    assert config.policy_config.vocab_size == len(VOCABULARY) - 4


@pytest.mark.parametrize("damage, message", [
    (lambda d: [p.unlink() for p in d.glob("*.safetensors*")], "neither model.safetensors"),
    (lambda d: next(d.glob("model-00001-*.safetensors")).write_bytes(b"\x00\x01"), "cannot read"),
])
async def test_unreadable_weights_fail_before_any_process_and_keep_the_run_record(
        tmp_path, damage, message):
    ckpt = _hf_checkpoint(tmp_path / "ckpt")
    damage(ckpt)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("an earlier run's record")
    config = build_config({**SMALL, "hf-checkpoint": str(ckpt), "output-dir": str(out)})
    with pytest.raises(ConfigError, match=f"--hf-checkpoint .*{message}"):
        await launch(config)
    assert (out / "config.json").read_text() == "an earlier run's record"


def test_trainer_save_hf_loads_in_transformers_with_the_same_logits(tmp_path):
    from replayrl.trainer.backends.torch_backend import TorchBackend
    from replayrl.trainer.config import TrainerConfig

    ckpt = _hf_checkpoint(tmp_path / "ckpt")
    (ckpt / "tokenizer_config.json").write_text("{}")  # stands for the checkpoint's tokenizer
    backend = TorchBackend(str(ckpt), TrainerConfig(), vocab_tokens=[])
    with torch.no_grad():
        for p in backend.model.parameters():  # a trained policy differs from the initial one
            p.add_(0.05 * torch.randn(p.shape))
    out = tmp_path / "saved"
    backend.save_hf(out)
    assert (out / "tokenizer_config.json").read_text() == "{}"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = torch.randint(0, len(VOCABULARY), (2, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        want = backend.model(ids, pos).logits
        got = hf(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


async def test_run_from_hf_checkpoint_saves_hf_checkpoints(tmp_path):
    ckpt = _hf_checkpoint(tmp_path / "ckpt")
    config = build_config({**SMALL, "num-steps": 3, "save-interval": 2, "lr": 1e-2,
                           "hf-checkpoint": str(ckpt), "save-hf": str(tmp_path / "hf"),
                           "output-dir": str(tmp_path / "run")})
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("indexer_flip_rate" not in r for r in rows)  # not applicable, never 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step-2", "step-3"]
    assert not (tmp_path / "run" / "checkpoint-init").exists()  # started from the given one
    initial, _ = load_pretrained(ckpt)
    final, cfg = load_pretrained(tmp_path / "hf" / "step-3")
    assert cfg == initial.config
    assert not torch.equal(final.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "step-3",
                                                           dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = torch.tensor([[1, 4, 5, 6, 7, 9]])
    pos = torch.arange(6)[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids, position_ids=pos).logits,
                                   final(ids, pos).logits, atol=1e-5, rtol=0)
