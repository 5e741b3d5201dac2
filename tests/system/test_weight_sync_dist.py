"""``--weight-sync dist`` across processes on the CPU (gloo): a bucketed push arrives whole in
another process, and a run's every push reaches both engines, whose weights then equal the
trainer's, tensor by tensor (the engines in float32, so equal means bit for bit)."""
from __future__ import annotations

import json
import multiprocessing

import numpy as np
import torch

from replayrl.rollout.weight_sync import dist_group, resolve_weight_sync
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, launch, write_initial_checkpoint
from tests.weight_recorders import recorded, recording_specs


def _receiver(port: int, specs: list, out) -> None:
    """Rank 1 of a two-rank gloo weight group (another process): receive ``specs`` and send
    back the tensors as float64 numpy arrays."""
    group = dist_group.join_group(backend="gloo", master_address="127.0.0.1", master_port=port,
                                  rank=1, world_size=2, group_name="test-weights", timeout_s=60)
    got = {}
    for spec in specs:
        got.update({k: (str(v.dtype), v.double().numpy()) for k, v in
                    dist_group.receive_bucket(spec, group, "cpu").items()})
    out.put(got)
    dist_group.destroy_group(group)


def test_a_push_broadcast_in_buckets_arrives_whole_in_another_process():
    # mixed dtypes in one bucket: an fp32 tensor after an odd number of fp16 bytes lands
    # misaligned and is still read right; a 3-bucket push of the dist sync's own packing
    tensors = {"h": torch.randn(3).half(), "f": torch.randn(4, 2), "b": torch.randn(5).bfloat16(),
               "g": torch.randn(300)}
    sync = resolve_weight_sync("dist")(bucket_bytes=64)
    packed = sync.pack(tensors, version=0)
    specs = packed.payload["buckets"]
    assert [s["names"] for s in specs] == [["h", "f", "b"], ["g"]]
    assert packed.payload["backend"] == "gloo"
    store = dist_group.make_store(2, 60)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_receiver, args=(store.port, specs, out))
    child.start()
    try:
        group = dist_group.join_group(backend="gloo", master_address="127.0.0.1",
                                      master_port=store.port, rank=0, world_size=2,
                                      group_name="test-weights", timeout_s=60, store=store)
        for data in packed.keep:
            dist_group.broadcast_bucket(data, group)
        got = out.get(timeout=60)
        dist_group.destroy_group(group)
    finally:
        child.join(60)
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name][0] == str(t.dtype)
        np.testing.assert_array_equal(got[name][1], t.double().numpy(), err_msg=name)


async def test_every_dist_push_leaves_both_engines_with_the_trainers_weights(tmp_path):
    config = build_config({"num-steps": 3, "num-engines": 2, "weight-sync": "dist",
                           "engine-dtype": "float32", "rollout-batch-size": 4,
                           "n-samples-per-prompt": 4, "progress": False,
                           "output-dir": str(tmp_path / "run")})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    specs = recording_specs(actor_specs(config, checkpoint), tmp_path / "weights")
    result = await launch(config, specs=specs)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["trainer_version"] for r in rows] == [1, 2, 3]
    assert all(r["weight_push_bytes"] > 0 for r in rows)
    weights = recorded(tmp_path / "weights")
    # the first push, then one after each step but the last (whose weights nobody generates with)
    assert sorted(v for name, v in weights if name == "trainer") == [0, 1, 2]
    for engine in ("engine_0", "engine_1"):
        loaded = sorted(v for name, v in weights if name == engine)
        assert loaded[:2] == [0, 1]  # the last push may still be loading when the run ends
        for version in loaded:
            got, want = weights[(engine, version)], weights[("trainer", version)]
            assert sorted(got) == sorted(want)
            for name, array in want.items():
                np.testing.assert_array_equal(got[name], array, err_msg=f"{engine} v{version} {name}")
    first, second = weights[("trainer", 0)], weights[("trainer", 1)]
    assert any(not np.array_equal(first[k], second[k]) for k in first)  # the push carried a step
