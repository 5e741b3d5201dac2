"""--train-backend megatron on a family room checkpoint (deepseek_v3 / glm4_moe_lite, and with the DSA
indexer deepseek_v32 / glm_moe_dsa): megatron-core's MLA GPTModel against transformers' own model,
under torchrun (gloo, CPU).

One two-rank torchrun builds the model in three layouts of its world (TP=1 with two
data-parallel replicas, TP=2 with sequence parallelism, EP=2; the DSA families in the first
two): float32 logits and gradients equal
transformers' within 1e-5 in each, the gathered Hugging Face weights equal the checkpoint
exactly (the conversion table both ways, with the shards of every layout), and R3 replays the
engine's routing: with every router perturbed megatron's own choice differs from the engine's
trace, replaying the trace uses exactly the engine's experts and gives transformers' logits for
the same perturbed routers replaying the same trace. A Hugging Face ``qwen3_moe`` checkpoint
(the embedded model's path, megatron_model.py) is checked the same way, its TP 1 logits also
against transformers' own Qwen3-MoE. On the DSA families the indexer's key slots
likewise: with the indexers perturbed too their own choice differs from the engine's, replaying
the engine's slots (-1 slots selecting nothing) uses exactly them, a row of only -1 keeps the
indexer's choice (transformers' on the same weights), and the logits are transformers' replayed
ones; GLM-5's checkpoint has a "shared" layer (the previous indexed layer's keys).

The same torchrun checks one megatron-core gated DeltaNet layer (Qwen3.5-MoE's linear attention)
against transformers' on CPU, with torch code bound in place of flash-linear-attention's; the
Qwen3.5-MoE model on megatron is not built (refused, megatron_families.py).

megatron-core runs in torchrun worker processes (tests/megatron_family_worker.py), never in the
pytest process: its CPU compatibility layer is process-wide."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from tests.child_env import PYTHONPATH  # noqa: E402
from tests.family_checkpoints import tiny_hf_config  # noqa: E402
from tests.paths import REPO  # noqa: E402
from tests.ports import port_block  # noqa: E402

WORKER = str(REPO / "tests" / "megatron_family_worker.py")
LAYOUTS = ("1,1", "2,1", "1,2")  # tp,ep
DSA_LAYOUTS = ("1,1", "2,1")  # the experts under EP are the MLA families' (checked there)


def _checkpoint(directory: Path, family: str) -> Path:
    """A tiny random ``family`` checkpoint: 16 experts in 4 groups, top-4 from the best 2 groups
    (each group scored by its top 2, as both implementations do), a shared expert, one dense
    first layer, a random expert bias (transformers initialises it to 0, which would not test
    its mapping) and weights scaled up so that top-k choices are not near ties."""
    from transformers import AutoModelForCausalLM

    extra = {"num_nextn_predict_layers": 0} if family == "deepseek_v3" else {}
    if family == "glm_moe_dsa":
        extra = {"indexer_types": ["full", "shared", "full"]}
    if family == "qwen3_moe":  # two MoE layers, 16 experts top-4, renormalised as Qwen3-30B-A3B
        cfg = tiny_hf_config(family, num_experts=16, num_experts_per_tok=4, vocab_size=96,
                             norm_topk_prob=True)
    else:
        cfg = tiny_hf_config(family, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                             topk_group=2, vocab_size=96, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(5.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(directory)
    return directory


DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
FAMILIES = ("deepseek_v3", "glm4_moe_lite", *DSA_FAMILIES, "qwen3_moe")
"""``qwen3_moe`` loads as the embedded model and trains on its GPTModel (megatron_model.py)."""


def test_megatron_mla_model_equals_transformers_in_every_layout(tmp_path):
    ckpts = [str(_checkpoint(tmp_path / family, family))
             + ("@" + "/".join(DSA_LAYOUTS) if family in DSA_FAMILIES else "") for family in FAMILIES]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         f"--master-port={port_block()}", WORKER, str(tmp_path / "out"), "/".join(LAYOUTS), *ckpts],
        cwd=REPO, env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = dict(np.load(tmp_path / "out" / "result.npz"))
    for i, family in enumerate(FAMILIES):
        r = {k[len(f"c{i}_"):]: v for k, v in result.items() if k.startswith(f"c{i}_")}
        trace = r["trace"]
        # layers 1, 2 are MoE, layer 0 dense (qwen3_moe: its two layers)
        assert trace.shape == (2, 12, 2, 4), family
        if family == "qwen3_moe":  # transformers' own model, not only the embedded one
            np.testing.assert_allclose(r["tp1_ep1_logits"], r["transformers_logits"], atol=1e-5,
                                       rtol=0, err_msg=family)
        for layout in ("tp1_ep1", "tp2_ep1") + (() if family in DSA_FAMILIES else ("tp1_ep2",)):
            np.testing.assert_allclose(r[f"{layout}_logits"], r["hf_logits"], atol=1e-5, rtol=0,
                                       err_msg=f"{family} {layout}")
            assert r[f"{layout}_roundtrip"] == 0.0, (family, layout)
            if layout != "tp1_ep2":  # gradients of sum(logits * probe), relative to the largest
                assert r[f"{layout}_grad_diff"] < 1e-5, (family, layout, r[f"{layout}_grad_diff"])
            own = np.sort(r[f"{layout}_own"], -1)
            # the perturbed routers choose otherwise on many tokens
            assert (own != np.sort(trace, -1)).any(-1).mean() > 0.2, (family, layout)
            np.testing.assert_array_equal(r[f"{layout}_used"], trace, err_msg=f"{family} {layout}")
            np.testing.assert_allclose(r[f"{layout}_replay_logits"], r["hf_replay_logits"],
                                       atol=1e-5, rtol=0, err_msg=f"{family} {layout}")
        # the perturbed routers' weights changed the function (replay keeps only the choice)
        assert np.abs(r["hf_replay_logits"] - r["hf_logits"]).max() > 1e-3, family
        if "index_trace" in r:
            _check_indexer_replay(r, family)
    # Qwen3.5-MoE's linear attention: megatron-core's GatedDeltaNet on CPU (the torch chunked
    # rule in place of flash-linear-attention) equals transformers' layer, output and input
    # gradient within 1e-5 of the largest entry
    for key in ("out", "grad"):
        ref = result[f"gdn_hf_{key}"]
        assert np.abs(ref).max() > 1.0, key  # the layer computes something
        np.testing.assert_allclose(result[f"gdn_{key}"], ref, atol=1e-5 * np.abs(ref).max(),
                                   rtol=0, err_msg=key)


def _check_indexer_replay(r: dict, family: str) -> None:
    """The DSA indexer's replay in every layout (see the module docstring)."""
    index = r["index_trace"]  # [B, S, L_idx, K]; row 0's last query all -1
    assert index.shape == ((2, 12, 2, 4) if family == "glm_moe_dsa" else (2, 12, 3, 4)), family
    assert (index[:, :3] == -1).any() and (index[0, -1] == -1).all(), family  # -1 slots are replayed
    hf = r["hf_replay_index"]
    np.testing.assert_array_equal(np.delete(hf, -1, 1)[0], np.delete(index, -1, 1)[0])
    np.testing.assert_array_equal(hf[1], index[1])
    # megatron-core's indexer KL loss (--dsa-indexer-loss-coeff): only the indexer's weights
    # get its gradient (the policy's equal transformers' frozen-indexer ones), at TP 2 + SP the
    # same as at TP 1
    one = {k[len("tp1_ep1_kl_grad."):]: v for k, v in r.items() if k.startswith("tp1_ep1_kl_grad.")}
    assert len(one) == 5 * index.shape[2], family  # wq_b, wk, k_norm weight / bias, weights_proj
    top = max(np.abs(g).max() for g in one.values())
    assert top > 0 and all(np.abs(g).max() > 0 for k, g in one.items() if "k_norm.bias" not in k)
    for k, g in one.items():
        np.testing.assert_allclose(r[f"tp2_ep1_kl_grad.{k}"], g, atol=1e-5 * top, rtol=0, err_msg=k)
    for layout in ("tp1_ep1", "tp2_ep1"):
        assert r[f"{layout}_kl_grad_diff"] < 1e-5, (family, layout, r[f"{layout}_kl_grad_diff"])
    for layout in ("tp1_ep1", "tp2_ep1"):
        own, used = r[f"{layout}_index_own"], r[f"{layout}_index_used"]
        # the perturbed indexers choose otherwise on many queries
        assert (np.sort(own, -1) != np.sort(index, -1)).any(-1).mean() > 0.2, (family, layout)
        np.testing.assert_array_equal(used, hf, err_msg=f"{family} {layout}")
        # the all -1 row: the indexer's own choice in the replayed forward
        np.testing.assert_array_equal(used[0, -1], r[f"{layout}_index_replay_own"][0, -1],
                                      err_msg=f"{family} {layout}")
        assert (used[0, -1] >= 0).all(), (family, layout)
