"""bf16 expert groups padded to a few sizes: where each pair goes, and the same outputs."""
from __future__ import annotations

import torch

import replayrl.rollout.model.qwen3_moe as qwen3_moe
from replayrl.rollout.model.config import default_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM, _expert_slots, padded_group_sizes


def test_group_sizes_round_up_to_multiples_of_8_then_32_then_128():
    counts = torch.tensor([0, 1, 8, 9, 64, 65, 256, 257, 300])
    assert padded_group_sizes(counts).tolist() == [0, 8, 8, 16, 64, 96, 256, 384, 384]


def test_each_pair_lands_in_its_experts_padded_group_in_token_order():
    # experts of pairs 0..5; by hand: expert 0 gets pairs 1, 4 (rows 0-1, padded to 8),
    # expert 1 nothing, expert 2 pairs 0, 2, 3, 5 (rows 8-11, padded to 16)
    pairs = torch.tensor([2, 0, 2, 2, 0, 2])
    source, position, ends = _expert_slots(pairs, 3, pad=True)
    assert ends.tolist() == [8, 8, 16]
    assert source.tolist() == [1, 4] + [-1] * 6 + [0, 2, 3, 5] + [-1] * 4
    assert position.tolist() == [8, 0, 9, 10, 1, 11]
    source, position, ends = _expert_slots(pairs, 3, pad=False)
    assert (source.tolist(), position.tolist(), ends.tolist()) == (
        [1, 4, 0, 2, 3, 5], [2, 0, 3, 4, 1, 5], [2, 2, 6])


def test_padded_bf16_groups_give_the_unpadded_logits(monkeypatch):
    # bit for bit with the oneDNN / AMX kernels this was measured on; another CPU's kernel for
    # a padded size may round differently, so the test allows bf16 rounding of the logits
    model = Qwen3MoeForCausalLM(default_config(30))
    model.init_weights(0)
    model = model.to(torch.bfloat16)
    tokens = torch.randint(0, 30, (5, 7), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(7).expand_as(tokens)
    rows: list[tuple[int, list[int]]] = []
    grouped_mm = qwen3_moe._grouped_mm
    monkeypatch.setattr(qwen3_moe, "_grouped_mm", lambda r, w, e: rows.append((len(r), e.tolist()))
                        or grouped_mm(r, w, e))
    with torch.inference_mode():
        padded = model(tokens, positions).logits
        padded_rows, rows[:] = list(rows), []
        monkeypatch.setattr(qwen3_moe, "_PADDED_GROUP_DTYPES", ())
        unpadded = model(tokens, positions).logits
    pairs = 5 * 7 * model.config.num_experts_per_tok
    assert all(n == pairs for n, _ in rows)  # unpadded: one row per (token, slot) pair
    assert all(n > pairs and all(end % 8 == 0 for end in ends) for n, ends in padded_rows)
    torch.testing.assert_close(padded.float(), unpadded.float(), rtol=2 ** -7, atol=2 ** -7)
