"""--train-backend megatron against the torch trainer, and its parallel layouts under torchrun
(gloo, CPU): the same logprobs (support replay with R3 and indexer replay, full vocabulary),
routing and indexer choices, weights and
optimizer step as the torch backend for the same checkpoint; TP=2+SP, EP=2, DP=2 with the
distributed optimizer, PP=2 (megatron's pipeline schedule), CP=2 and TP=2+SP x CP=2 give the
one-rank values, and so do PP=2 and CP=2 on the deepseek_v3 / glm4_moe_lite family checkpoints
(megatron-core's MLA, in the same torchruns); record -> perturb the router -> replay restores
the routing, also with the routers of the last pipeline stage perturbed; pipeline stages feed
their routers and indexers the right global layers of the traces and hold no other stage's;
under sequence parallelism each router replays the rows of the tokens it scores.

megatron-core runs in torchrun worker processes (tests/megatron_worker.py), never in the pytest
process: its CPU compatibility layer is process-wide."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from replayrl.rollout.model.loader import load_pretrained  # noqa: E402
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY  # noqa: E402
from replayrl.trainer.backends import resolve_backend  # noqa: E402
from replayrl.trainer.backends.torch_backend import TorchBackend  # noqa: E402
from replayrl.trainer.batching.batch import collate  # noqa: E402
from replayrl.trainer.config import TrainerConfig  # noqa: E402
from replayrl.trainer.errors import CheckpointLayoutError  # noqa: E402
from tests import megatron_cases as cases  # noqa: E402
from tests.child_env import PYTHONPATH
from tests.paths import REPO
from tests.ports import port_block

WORKER = str(REPO / "tests" / "megatron_worker.py")
STEP_ATOL = 5e-4
"""Weights after one Adam step at lr 1e-2: each entry moves by ~lr * g / (|g| + eps), so entries
whose gradient is near eps differ by reduction-order rounding (measured up to 2e-4 between
layouts); a wrong clip, scale or update moves entries by ~lr = 1e-2."""



def _run(checkpoint: Path, out: Path, nproc: int, *args: str) -> dict[str, np.ndarray]:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
         f"--master-port={port_block()}", WORKER, str(checkpoint), str(out), *args],
        cwd=REPO, env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(np.load(out / "result.npz"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return cases.write_checkpoint(tmp_path_factory.mktemp("ckpt"))


FAMILIES = ("deepseek_v3", "glm4_moe_lite")
FAMILY_RUN = ("--pp", "2")
"""The layout whose two-rank torchrun also runs the family checkpoints at PP=2 and at CP=2 (the
parallel groups rebuilt in its processes: no process start of their own)."""


def _family_flags(family_checkpoints: dict, layouts: str) -> list[str]:
    return [*(a for c in family_checkpoints.values() for a in ("--family", str(c))),
            "--family-layouts", layouts]


@pytest.fixture(scope="module")
def one_rank(checkpoint, family_checkpoints, tmp_path_factory):
    """The ``main`` case on one rank, with each family checkpoint's (``<family>/one/``)."""
    return _run(checkpoint, tmp_path_factory.mktemp("tp1"), 1, "--case", "main",
                *_family_flags(family_checkpoints, "one"))


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    """Tiny random deepseek_v3 and glm4_moe_lite checkpoints with 4 layers (dense layer 0, MoE
    layers 1-3: PP=2 puts MoE layers on both stages), written by transformers."""
    from tests.family_checkpoints import tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        extra = {"num_nextn_predict_layers": 0} if family == "deepseek_v3" else {}
        tiny_hf_checkpoint(family, root / family, num_hidden_layers=4, **extra)
    return {family: root / family for family in FAMILIES}


@pytest.fixture(scope="module")
def layout_run(checkpoint, family_checkpoints, tmp_path_factory):
    """``layout_run(nproc, layout)``: the ``main`` case's values under ``layout`` (one torchrun
    per layout in the module, shared by the tests that read it); the :data:`FAMILY_RUN` one
    also computes the family checkpoints' values at PP=2 and CP=2 (``<family>/pp2/``,
    ``<family>/cp2/``, tests/megatron_worker.py)."""
    runs = {}

    def run(nproc: int, layout: tuple[str, ...]) -> dict[str, np.ndarray]:
        if (nproc, layout) not in runs:
            families = _family_flags(family_checkpoints, "pp2/cp2") if layout == FAMILY_RUN else []
            runs[nproc, layout] = _run(checkpoint, tmp_path_factory.mktemp("layout"), nproc,
                                       "--case", "main", *layout, *families)
        return runs[nproc, layout]

    return run


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The torch backend on the same inputs (independent implementation)."""
    torch.set_num_threads(1)
    cfg = TrainerConfig(temperature=0.8, lr=1e-2)
    backend = TorchBackend(str(checkpoint), cfg, list(VOCABULARY))
    samples = cases.samples(cases.perturbed(checkpoint))
    replayed = collate(samples, routing=True, indexer=True, support=True)
    plain = collate(samples, routing=False, indexer=False, support=False)
    a, b = backend.preflight_logprobs(replayed), backend.preflight_logprobs(plain)
    out = dict(logp_replay=a.logprobs.numpy(), used=a.routed_experts.numpy(),
               own=a.own_routed_experts.numpy(), logp_plain=b.logprobs.numpy(),
               trace=replayed.routed_experts.numpy(), index_used=a.indexer_topk.numpy(),
               index_own=a.own_indexer_topk.numpy(), index_trace=replayed.indexer_topk.numpy(),
               tokens_real=replayed.key_padding_mask.numpy())
    out.update({f"w0/{k}": v for k, v in backend.weights().items()})
    backend.zero_grad()
    backend.backward(-backend.train_logprobs(replayed).sum())
    out["grad_norm"] = np.array(backend.clip_and_step(1.0))
    out.update({f"w1/{k}": v for k, v in backend.weights().items()})
    return out


def _assert_same_values(got: dict, ref: dict, close: tuple = (), exact: tuple = ()) -> None:
    """``got`` is the run ``ref``: its ``close`` arrays within 1e-5, its ``exact`` arrays equal,
    and the same clipped Adam step (gradient norm within 1e-5 relative, the stepped weights
    ``w1/*`` within :data:`STEP_ATOL`)."""
    for key in close:
        np.testing.assert_allclose(got[key], ref[key], atol=1e-5, err_msg=key)
    for key in exact:
        assert np.array_equal(got[key], ref[key]), key
    assert float(got["grad_norm"]) == pytest.approx(float(ref["grad_norm"]), rel=1e-5)
    for k in (k for k in ref if k.startswith("w1/")):
        np.testing.assert_allclose(got[k], ref[k], atol=STEP_ATOL, err_msg=k)


def test_registry_resolves_megatron_lazily():
    cls = resolve_backend("megatron")
    assert cls.__name__ == "MegatronBackend"


def test_layouts_that_do_not_divide_the_model_name_the_flag():
    from replayrl.trainer.backends.megatron_model import MegatronParallel, transformer_config
    from replayrl.trainer.errors import MegatronModelError

    with pytest.raises(MegatronModelError, match=r"num_hidden_layers=4 is not a multiple of --pp-size 3"):
        transformer_config(cases.config(), MegatronParallel(pp=3))
    with pytest.raises(MegatronModelError, match=r"num_experts=8 is not a multiple of --ep-size 3"):
        transformer_config(cases.config(), MegatronParallel(ep=3))


def test_megatron_backend_matches_the_torch_trainer(one_rank, reference):
    got, ref = one_rank, reference
    np.testing.assert_allclose(got["logp_replay"], ref["logp_replay"], atol=2e-5)
    np.testing.assert_allclose(got["logp_plain"], ref["logp_plain"], atol=2e-5)
    # R3: the forward used the engine's routing where captured; own choice = the torch router's
    real = ref["trace"] >= 0
    assert np.array_equal(got["used"][real], ref["trace"][real])
    # at padding positions the two models' (unused) hidden states differ: the torch model lets a
    # padding query see only real keys and itself, megatron's causal mask every earlier slot
    tok = ref["tokens_real"]
    assert np.array_equal(got["used"][tok], ref["used"][tok])
    assert np.array_equal(got["own"][tok], ref["own"][tok])
    assert (got["own"][real] != ref["trace"][real]).any(), "the replayed trace must differ somewhere"
    # indexer replay: the engine's key slots where captured; own choice = the torch indexer's
    real = (ref["index_trace"] >= 0).any(-1)
    assert np.array_equal(got["index_used"][real], ref["index_trace"][real])
    assert np.array_equal(got["index_used"], ref["index_used"])
    assert np.array_equal(got["index_own"], ref["index_own"])
    assert (got["index_own"][real] != ref["index_trace"][real]).any()
    # weights converted both ways: the engine's weights, bit for bit
    for k in (k for k in ref if k.startswith("w0/")):
        assert np.array_equal(got[k], ref[k]), k
    # one clipped Adam step: same norm and weights (megatron's Adam vs torch AdamW, fp32)
    _assert_same_values(got, ref)


@pytest.mark.parametrize("nproc,layout", [
    (2, ("--tp", "2")), (2, ("--ep", "2")), (2, ("--pp", "2")), (2, ("--cp", "2")),
    (4, ("--tp", "2", "--cp", "2"))],
    ids=["tp2_sp", "ep2_dp2_distopt", "pp2", "cp2", "tp2_sp_cp2"])
def test_parallel_layouts_give_the_one_rank_values(layout_run, one_rank, nproc, layout):
    # CP (docs/design/megatron.md#context-parallel): each rank forwards 2 of 4 chunks of every row (13 positions
    # padded to 16) and attends to all keys; its logprobs, the routing it replays and records
    # and the indexer's choices over all keys come back in the one-rank order
    got = layout_run(nproc, layout)
    _assert_same_values(got, one_rank, close=("logp_replay", "logp_plain"),
                        exact=("used", "own", "index_used", "index_own"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["pp2", "cp2"])
def test_family_checkpoints_give_their_tp1_values_at_pp2_and_cp2(layout_run, one_rank, layout, family):
    # a family checkpoint as megatron-core's MLA GPTModel (docs/design/megatron.md#megatron-families):
    # PP=2 (stage 0: dense layer 0 and MoE layer 1; stage 1: MoE layers 2-3) and CP=2 (the MLA
    # keys and values gathered over CP) give the one-rank logprobs, routing and step, with R3
    # on: the engine's routes (its routers perturbed) are the ones used, flips 0
    got = layout_run(2, FAMILY_RUN)  # the family's PP=2 and CP=2 values are in this run
    tp1, f = ({k[len(prefix):]: v for k, v in run.items() if k.startswith(prefix)}
              for run, prefix in ((one_rank, f"{family}/one/"), (got, f"{family}/{layout}/")))
    trace = got[f"{family}/trace"]
    assert np.array_equal(trace, one_rank[f"{family}/trace"]) and trace.shape[2] == 3  # MoE 1-3
    real = trace >= 0
    assert (tp1["own"][real] != trace[real]).any(), "replay must force something"
    for run in (tp1, f):
        assert np.array_equal(run["used"][real], trace[real])  # flips 0
    _assert_same_values(f, tp1, close=("logp_replay", "logp_plain", "self_logp"),
                        exact=("used", "own", "plain_used", "self_used"))


@pytest.mark.parametrize("nproc,layout", [(1, None), (2, ("--tp", "2")), (4, ("--tp", "2", "--cp", "2"))],
                         ids=["one_rank", "tp2_sp", "tp2_sp_cp2"])
def test_replay_under_sequence_parallelism_gives_each_router_its_own_tokens_rows(
        layout_run, one_rank, nproc, layout):
    # under SP a router scores its SP slice of the tokens ([S / tp * B] rows, sequence-major)
    # and replays the matching rows of the trace (sp_slice): replaying the routers' own recorded
    # choice must then change nothing, on every row, padding included -- a slice of other
    # tokens' rows would route those tokens by someone else's experts (logprobs move) and the
    # routers' own choice under replay would no longer be the replayed one
    got = one_rank if layout is None else layout_run(nproc, layout)
    assert np.array_equal(got["self_used"], got["plain_used"])
    assert np.array_equal(got["self_own"], got["plain_used"])
    np.testing.assert_allclose(got["self_logp"], got["logp_plain"], atol=1e-6)


def test_dp2_distributed_optimizer_averages_the_ranks_gradients(checkpoint, reference, tmp_path):
    got = _run(checkpoint, tmp_path, 2, "--case", "main", "--split-data")
    # reference: the torch trainer on the mean of the two ranks' losses
    cfg = TrainerConfig(temperature=0.8, lr=1e-2)
    backend = TorchBackend(str(checkpoint), cfg, list(VOCABULARY))
    samples = cases.samples(cases.perturbed(checkpoint))
    backend.zero_grad()
    for r in range(2):
        part = collate(samples[r::2], routing=True, indexer=True, support=True)
        np.testing.assert_allclose(got[f"rank{r}/logp_replay"],
                                   backend.preflight_logprobs(part).logprobs.numpy(), atol=2e-5)
        backend.backward(-0.5 * backend.train_logprobs(part).sum())
    assert float(got["grad_norm"]) == pytest.approx(backend.clip_and_step(1.0), rel=1e-5)
    for k, v in backend.weights().items():  # tolerance as in the one-rank comparison
        np.testing.assert_allclose(got[f"w1/{k}"], v, atol=STEP_ATOL, err_msg=k)


def _torch_backend_with(checkpoint, got: dict):
    """The torch trainer holding the worker's gathered (perturbed) weights ``got["w/NAME"]``,
    and the perturbed case's batch (support replay, no traces)."""
    model, _ = load_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(got[f"w/{n}"]))
    backend = TorchBackend(str(checkpoint), TrainerConfig(temperature=0.8), list(VOCABULARY))
    backend.model.load_state_dict(model.state_dict())
    batch = collate(cases.samples(cases.perturbed(checkpoint)), routing=False, indexer=False, support=True)
    return backend, batch


def test_record_perturb_replay_restores_the_routing(checkpoint, tmp_path):
    got = _run(checkpoint, tmp_path, 1, "--case", "r3")
    rec, free, used, own = got["recorded"], got["free"], got["used"], got["own"]
    assert (free != rec).any(), "the perturbed router must route some token differently"
    assert np.array_equal(used, rec)           # replay restores the recorded routing
    # the first MoE layer sees the same input with and without replay: its own choice under
    # replay is the perturbed router's (later layers' inputs depend on the replayed routing)
    assert np.array_equal(own[:, :, 0], free[:, :, 0])
    assert (own[:, :, 0] != used[:, :, 0]).any()
    # independent: the embedded torch model with the perturbed weights and the same replay
    backend, batch = _torch_backend_with(checkpoint, got)
    ref = backend.preflight_logprobs(dataclasses.replace(batch, routed_experts=torch.from_numpy(rec)))
    np.testing.assert_allclose(got["logp"], ref.logprobs.numpy(), atol=2e-5)


def _flip_rate(used: np.ndarray, forced: np.ndarray) -> float:
    """Fraction of the captured (token, layer) rows of ``forced`` [B, S, L, K] whose expert set
    differs from ``used``'s."""
    real = (forced >= 0).all(-1)
    same = (np.sort(used, -1) == np.sort(forced, -1)).all(-1)
    return float((~same[real]).mean())


def test_replay_reaches_the_live_model_after_a_second_one_is_built(checkpoint, reference, tmp_path):
    # verl#7340's class: megatron-core keeps every RouterReplay ever built in one global list, so
    # a model built after this one took its replay; replay must act on the model it is given
    got = _run(checkpoint, tmp_path, 1, "--case", "rebuilt")
    forced = reference["trace"]
    real = forced >= 0
    assert (reference["own"][real] != forced[real]).any(), "the forced routes must differ from the own"
    for when in ("alive", "dropped"):  # the second model alive, then dropped
        used, logp = got[f"used_{when}"], got[f"logp_{when}"]
        flips = _flip_rate(used, forced)
        diff = float(np.abs(logp - reference["logp_replay"]).max())
        assert flips == 0.0 and np.array_equal(used[real], forced[real]), (when, flips, diff)
        # independent: the torch backend replaying the same trace on the same weights
        np.testing.assert_allclose(logp, reference["logp_replay"], atol=2e-5, err_msg=when)
    np.testing.assert_array_equal(got["index_alive"], reference["index_used"])
    # a second RoutingReplay over the same model took its routers: the first one refuses by layer
    refused = str(got["refused"])
    assert refused.startswith("ReplayTargetError: "), refused
    assert "layer 1" in refused, refused


@pytest.mark.parametrize("nproc,layout,saved", [
    (1, (), dict(dp_size=1)), (2, ("--ep", "2"), dict(dp_size=2, ep_size=2)),
    (2, ("--pp", "2"), dict(dp_size=1, pp_size=2))], ids=["one_rank", "ep2", "pp2"])
def test_checkpoint_round_trip_restores_weights_optimizer_and_version(checkpoint, tmp_path, nproc,
                                                                     layout, saved):
    got = _run(checkpoint, tmp_path, nproc, "--case", "ckpt", *layout)
    assert int(got["version"]) == 5
    assert bool(got["same_keys"]) and bool(got["same_values"]) and bool(got["opt_keys"])
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "model" / "config.json").exists()
    # every rank file records the world's layout (the worker gave it as --tp/--ep/--pp over
    # its torchrun world, never as TrainerConfig flags); only the same flags resume it
    cls = resolve_backend("megatron")
    assert cls.check_checkpoint(ckpt, TrainerConfig(train_backend="megatron", **saved)) == 5
    other = dict(saved, dp_size=saved["dp_size"] * 2) if nproc == 1 else dict(dp_size=1, tp_size=2)
    with pytest.raises(CheckpointLayoutError, match="was saved with"):
        cls.check_checkpoint(ckpt, TrainerConfig(train_backend="megatron", **other))


def test_pipeline_r3_replays_the_last_stages_own_layers(checkpoint, tmp_path):
    # docs/design/megatron.md#pipeline-parallel: PP=2, routers perturbed on stage 1 only (layers 2-3, trace columns
    # 1-2); stage 0's layer 1 (column 0) routes as recorded, stage 1's layers route differently
    # until the recorded trace is replayed: each stage must feed its routers its own columns
    got = _run(checkpoint, tmp_path, 2, "--case", "r3", "--pp", "2", "--perturb-last-stage")
    rec, free, used, own = got["recorded"], got["free"], got["used"], got["own"]
    assert np.array_equal(free[:, :, 0], rec[:, :, 0])
    assert (free[:, :, 1:] != rec[:, :, 1:]).any(), "the perturbed routers must route differently"
    assert np.array_equal(used, rec)  # choices of both stages, back in global layer order
    assert np.array_equal(own[:, :, 1], free[:, :, 1])  # layer 2's input is stage 0's, unchanged
    assert (own[:, :, 1] != used[:, :, 1]).any()
    # independent: the embedded torch model with the gathered (perturbed) weights, same replay
    backend, batch = _torch_backend_with(checkpoint, got)
    ref = backend.preflight_logprobs(dataclasses.replace(batch, routed_experts=torch.from_numpy(rec)))
    np.testing.assert_allclose(got["logp"], ref.logprobs.numpy(), atol=2e-5)
    free_ref = backend.preflight_logprobs(batch)
    tok = batch.key_padding_mask.numpy()
    assert np.array_equal(free[tok], free_ref.routed_experts.numpy()[tok])


def test_pipeline_stages_hold_only_their_own_layers_routing_and_indexer_streams(checkpoint, tmp_path):
    # the routing and indexer streams of a stage are sliced by its layer offset: the trace
    # columns of its own global layers, none of another stage's
    got = _run(checkpoint, tmp_path, 2, "--case", "pp", "--pp", "2")
    cfg = cases.config()  # 4 layers, MoE on 1..3: stage 0 holds layers 0-1, stage 1 layers 2-3
    assert got["layers0"].tolist() == [1] and got["layers1"].tolist() == [2, 3]
    assert got["indexed0"].tolist() == [1] and got["indexed1"].tolist() == [3]
    trace = got["trace"]  # [B, S, L_moe, K], columns in cfg.moe_layers order
    for rank in (0, 1):
        for layer in got[f"layers{rank}"].tolist():
            column = cfg.moe_layers.index(layer)
            want = trace[:, :, column].transpose(1, 0, 2).reshape(-1, trace.shape[-1])
            assert np.array_equal(got[f"target{rank}_{layer}"], want), (rank, layer)
    # the indexer trace [B, S, L_idx, K] has columns for layers 1 and 3; each stage's indexed
    # layer reads its own column (not column 0 on stage 1), and the other stage's is refused
    index_trace = collate(cases.samples(cases.perturbed(checkpoint)), routing=False, indexer=True,
                          support=False).indexer_topk.numpy()
    assert cfg.indexed_layers == (1, 3) and (index_trace[:, :, 0] != index_trace[:, :, 1]).any()
    assert np.array_equal(got["istream0_1"], index_trace[:, :, 0])
    assert np.array_equal(got["istream1_3"], index_trace[:, :, 1])
    for rank, foreign in ((0, 3), (1, 1)):
        assert str(got[f"foreign{rank}"]).startswith("ReplayError: ") and \
            f"layer {foreign}" in str(got[f"foreign{rank}"]), got[f"foreign{rank}"]


def test_torchrun_launcher_runs_the_megatron_trainer_rank(tmp_path, curve_keys_dir, torch_first_step):
    # the whole system (engines, manager, clock, TrainerActor) with the megatron trainer on one
    # rank: it steps, its weight pushes reach the engines (staleness 1 from the second step) and
    # the replayed routing / indexer choices are the engines' (flip rate 0); its first step is
    # the torch trainer's. Under torchrun the trainer is one rank of an actor world whose other
    # ranks never join a process group: the backend must make a process group of its own
    # instead of waiting for them. (`replayrl train` with megatron: the two-rank test below.)
    rows = _torchrun_train(tmp_path, 3, curve_keys_dir, "--train-backend", "megatron", steps=3)
    assert [r["trainer_version"] for r in rows] == [1, 2, 3]
    assert [r["staleness_max"] for r in rows] == [0, 1, 1]
    assert all(r["routing_flip_rate"] == 0 and r["indexer_flip_rate"] == 0 for r in rows)
    assert rows[0]["loss_tokens"] == torch_first_step["loss_tokens"]
    assert rows[0]["grad_norm"] == pytest.approx(torch_first_step["grad_norm"], rel=1e-4)


def _train(out: Path, steps: int, *flags: str) -> list[dict]:
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "replayrl.tools.cli", "train", "--num-steps", str(steps),
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-progress",
         "--output-dir", str(out), *flags],
        cwd=REPO, env={**os.environ, "PYTHONPATH": PYTHONPATH}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def torch_first_step(tmp_path_factory):
    """The one-rank torch trainer's first step of the same run (the same first batch)."""
    return _train(tmp_path_factory.mktemp("torch1"), 1)[0]


def _torchrun_train(out: Path, nproc: int, curve_keys: str, *flags: str, steps: int = 2) -> list[dict]:
    """``torchrun --nproc-per-node nproc -m replayrl.tools.run.torchrun_entry`` for ``steps`` steps, the
    flags of :func:`_train`; the metrics rows."""
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
         f"--master-port={port_block()}", "-m", "replayrl.tools.run.torchrun_entry", "--num-steps", str(steps),
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-progress",
         "--output-dir", str(out), "--ready-timeout", "120", "--curve-keys", curve_keys, *flags],
        cwd=REPO, env={**os.environ, "PYTHONPATH": PYTHONPATH}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("launch,layout", [
    ("replayrl_train", ("--dp-size", "2", "--ep-size", "2")), ("torchrun", ("--tp-size", "2")),
    ("replayrl_train", ("--pp-size", "2")), ("replayrl_train", ("--pp-size", "2", "--preflight", "always")),
    ("replayrl_train", ("--cp-size", "2"))],
    ids=["dp2_ep2_distopt", "torchrun_tp2_sp", "pp2", "pp2_preflight", "cp2"])
def test_the_megatron_trainer_trains_on_two_ranks(tmp_path, torch_first_step, curve_keys_dir, launch,
                                                   layout):
    # docs/design/trainer-ranks.md#trainer-ranks: the trainer is two processes (trainer, trainer_1) in one megatron
    # world; both steps train, the second on samples from the pushed weights, and the first
    # takes the torch trainer's step on the same batch (same gradient norm). `replayrl train`
    # runs DP=2 + EP=2 with the distributed optimizer; torchrun runs TP=2 + SP on 4 ranks
    # (driver, one engine, trainer, trainer_1: the plan counts --dp-size x --tp-size trainer
    # ranks), its trainer ranks meeting in a group of their own inside the 4-rank world; PP=2
    # (docs/design/megatron.md#pipeline-parallel) and CP=2
    # (docs/design/megatron.md#context-parallel) run under `replayrl train` too
    if launch == "torchrun":
        rows = _torchrun_train(tmp_path, 4, curve_keys_dir, "--train-backend", "megatron", *layout)
    else:
        rows = _train(tmp_path, 2, "--train-backend", "megatron", *layout)
    assert [r["trainer_version"] for r in rows] == [1, 2]
    assert [r["staleness_max"] for r in rows] == [0, 1]
    assert all(r["routing_flip_rate"] == 0 and r["indexer_flip_rate"] == 0 for r in rows)
    first = rows[0]
    assert first["loss_tokens"] == torch_first_step["loss_tokens"]
    assert first["grad_norm"] == pytest.approx(torch_first_step["grad_norm"], rel=1e-4)
