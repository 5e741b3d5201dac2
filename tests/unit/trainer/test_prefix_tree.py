"""The prefix-tree layout: slots by hand, and a tree forward equal to every sample forwarded alone."""
from __future__ import annotations

import numpy as np
import torch

from replayrl.rollout.model.config import default_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sample import Sample
from replayrl.trainer.backends.torch_backend import response_logprobs
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.batching.prefix_tree import PrefixTree


def test_slots_segments_and_indexer_shift_by_hand():
    # rows 0, 2, 3 share prefix A, row 1 prefix B; P = 2, W = 4 -> branches of L = 2
    tree = PrefixTree.build(2, 4, torch.tensor([0, 1]), torch.tensor([0, 1, 0, 0]))
    assert tree.branch.tolist() == [0, 0, 1, 2]
    assert tree.tree_width == 2 + 3 * 2
    assert tree.slot.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 7]]
    assert tree.segment_ids().tolist() == [[-1, -1, 0, 0, 1, 1, 2, 2]] * 2
    x = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 9, 10], [1, 2, 11, 12]])
    assert tree.to_tree(x, 0).tolist() == [[1, 2, 3, 4, 9, 10, 11, 12], [5, 6, 7, 8, 0, 0, 0, 0]]
    assert torch.equal(tree.from_tree(tree.to_tree(x, 0)), x)
    # row 3 (branch 2): its own slots 0, 1 stay, 2 -> 6, 3 -> 7, -1 stays
    slots = torch.tensor([[0, -1], [1, 0], [2, 1], [3, 2]]).view(1, 4, 1, 2).expand(4, -1, -1, -1)
    moved = tree.indexer_to_tree(slots)
    assert moved[3, :, 0].tolist() == [[0, -1], [1, 0], [6, 1], [7, 6]]
    assert moved[0, :, 0].tolist() == [[0, -1], [1, 0], [2, 1], [3, 2]]
    assert torch.equal(tree.indexer_from_tree(tree.to_tree(moved, -1)), slots)


def _groups(seed: int):
    """Groups of 3 and 2 samples with 1-4 response tokens (so the branches hold padding and
    the indexer, keeping 8 keys, drops some), traces captured by forwarding each sample alone."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(default_config(30))
    model.init_weights(seed)
    rng = np.random.default_rng(seed)
    samples = []
    for g, lengths in enumerate(((4, 1, 3), (2, 4))):
        prompt = rng.integers(0, 30, 6).astype(np.int32)
        for R in lengths:
            response = rng.integers(0, 30, R).astype(np.int32)
            tokens = torch.from_numpy(np.r_[prompt, response].astype(np.int64))[None]
            with torch.no_grad():
                out = model(tokens[:, :-1], torch.arange(len(prompt) + R - 1)[None], capture=True)
            support = np.full((R, 1 + 5), -1, np.int32)
            support[:, 0] = support[:, 1] = response
            support[:, 2:] = [[v for v in rng.permutation(30) if v != y][:4] for y in response]
            samples.append(Sample(sample_id=len(samples), group_id=g, rollout_id=0,
                                  policy_version=0, prompt_ids=prompt, response_ids=response,
                                  loss_mask=np.ones(R, np.uint8),
                                  rollout_logprobs=np.zeros(R, np.float32), sample_support=support,
                                  routed_experts=out.routed_experts[0].numpy(),
                                  indexer_topk=out.indexer_topk[0].numpy()))
    return model, samples


def _run(model, samples, weights):
    model.zero_grad()
    logp, out = response_logprobs(model, collate(samples, routing=True, indexer=True, support=True),
                                  0.8, capture=True)
    (logp * weights).sum().backward()
    return logp.detach(), out, {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None}


def test_tree_forward_equals_each_sample_alone_with_uneven_groups_and_lengths():
    model, samples = _groups(3)
    lengths = [len(s.response_ids) for s in samples]
    assert any(s.indexer_topk.max() >= 6 for s in samples)  # replayed slots inside responses
    weights = torch.linspace(-1, 1, sum(lengths))
    logp, out, grads = _run(model, samples, weights)
    alone = [_run(model, [s], w) for s, w in zip(samples, weights.split(lengths))]
    assert torch.allclose(logp, torch.cat([a[0] for a in alone]), atol=1e-5)
    for b, s in enumerate(samples):
        n = s.total_length - 1
        for key in ("routed_experts", "indexer_topk", "own_routed_experts", "own_indexer_topk"):
            assert torch.equal(getattr(out, key)[b, :n], getattr(alone[b][1], key)[0, :n]), key
        assert torch.equal(out.indexer_topk[b, :n], torch.from_numpy(np.array(s.indexer_topk)).long())
    for name, g in grads.items():
        total = sum(a[2][name] for a in alone if name in a[2])
        assert torch.allclose(g, total, atol=1e-5), name
