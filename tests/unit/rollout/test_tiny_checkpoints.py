"""The tiny checkpoints a reader makes with examples/tiny_checkpoints/make_family_checkpoint.py
(the tests' shapes too, tests/family_checkpoints.py): one for every model type `--hf-checkpoint`
reads, the embedded model's two load with transformers' logits, and the script writes a
tokenizer the run reads."""
from __future__ import annotations

import pytest
import torch

from replayrl.rollout.model.families import FAMILIES
from replayrl.rollout.model.loader import load_pretrained
from tests.family_checkpoints import TINY


def test_every_type_hf_checkpoint_reads_has_a_tiny_config():
    # the embedded model's two and every family of the registry, nothing else
    assert sorted(TINY.TINY_TYPES) == sorted({"qwen3", "qwen3_moe", *FAMILIES})
    assert TINY.parse_args(["--family", "deepseek_v4", "--out", "x"]).family == "deepseek_v4"
    with pytest.raises(ValueError, match="'llama'.*deepseek_v4"):
        TINY.tiny_config("llama")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_embedded_types_load_with_transformers_logits_and_the_tokenizer(family, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
    from replayrl.rollout.text.tokenizer import load_tokenizer

    out = TINY.main(family, tmp_path / family)
    assert f"wrote {out} ({family}" in capsys.readouterr().out
    ours, cfg = load_pretrained(out)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert ref.config.model_type == family and (family == "qwen3_moe") == hasattr(ref.config, "num_experts")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        got, want = ours(ids, pos).logits, ref(input_ids=ids, position_ids=pos).logits
    assert want.abs().max() > 0.1  # not a near-zero comparison
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the built-in task's words, each its own id, below the model's vocabulary; it stops at <eos>
    tok = load_tokenizer(out)
    assert len(VOCABULARY) <= cfg.vocab_size
    assert tok.encode_prompt(" ".join(VOCABULARY[3:6])).tolist() == [3, 4, 5]
    assert tok.eos_token_ids == (VOCABULARY.index("<eos>"),)
