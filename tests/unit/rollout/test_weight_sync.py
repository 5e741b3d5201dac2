"""The weight-sync room (rollout/weight_sync/): each sync's pack and load against the tensors
pushed, the weight group's buckets, and the refusals before start (across processes:
tests/system/test_weight_sync_dist.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.errors import RolloutConfigError, WeightSyncError
from replayrl.rollout.weight_sync import WEIGHT_SYNC_CHOICES, WEIGHT_SYNCS, dist_group, resolve_weight_sync
from replayrl.rollout.weight_sync.base import sync_name
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.transport.array_bundle import pack_arrays, unpack_arrays


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g),
            "c.weight": torch.randn(2, 2, 4, generator=g)}


class RecordingEngine:
    """Stands in for an engine: keeps what ``load_weights`` got, as float32 numpy copies."""

    def __init__(self) -> None:
        self.loads: list[tuple[int, dict[str, np.ndarray]]] = []

    def load_weights(self, arrays, *, version: int) -> None:
        self.loads.append((version, {k: (v.float().numpy() if isinstance(v, torch.Tensor)
                                         else np.asarray(v, np.float32)).copy()
                                     for k, v in arrays.items()}))


def _same(got: dict[str, np.ndarray], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        np.testing.assert_array_equal(got[name], t.float().numpy(), err_msg=name)


def test_the_registry_names_every_sync_and_auto():
    assert set(WEIGHT_SYNCS) == {"zmq", "shm", "disk", "dist", "ipc"}
    assert WEIGHT_SYNC_CHOICES[0] == "auto"
    for name in WEIGHT_SYNCS:
        assert resolve_weight_sync(name).name == name
    with pytest.raises(RolloutConfigError, match="unknown weight sync 'nccl'; known: disk, dist"):
        resolve_weight_sync("nccl")


def test_a_payload_names_its_sync():
    assert sync_name(pack_arrays({"w": np.zeros(2, np.float32)})) == "zmq"
    assert sync_name({"weight_sync": "dist", "buckets": []}) == "dist"
    with pytest.raises(WeightSyncError, match="array bundle or a manifest"):
        sync_name({"buffers": []})


@pytest.mark.parametrize("name", ["zmq", "shm"])
def test_a_bundle_push_holds_the_tensors_and_loads_them(name):
    tensors = {**_tensors(), "d.half": torch.randn(4).half(), "e.bf16": torch.randn(3).bfloat16()}
    packed = resolve_weight_sync(name)().pack(tensors, version=2)
    arrays = unpack_arrays(packed.payload)
    assert packed.frames == (name == "zmq")  # zmq never goes through the shared-memory pool
    assert arrays["d.half"].dtype == np.float16 and arrays["e.bf16"].dtype == np.float32
    assert packed.nbytes == sum(a.nbytes for a in arrays.values())
    for k, t in tensors.items():
        torch.testing.assert_close(torch.from_numpy(np.array(arrays[k])).to(t.dtype), t, rtol=0, atol=0)
    engine = RecordingEngine()
    resolve_weight_sync(name)().load(engine, packed.payload, 2)
    assert engine.loads[0][0] == 2
    _same(engine.loads[0][1], {k: t.float() for k, t in tensors.items()})


def test_the_disk_push_is_a_file_the_engine_reads_and_old_versions_go(tmp_path):
    sync = resolve_weight_sync("disk")(directory=str(tmp_path / "pushes"))
    engine = RecordingEngine()
    for version in range(4):
        tensors = _tensors(version)
        packed = sync.pack(tensors, version=version)
        assert packed.payload == {"weight_sync": "disk",
                                  "path": str(tmp_path / "pushes" / f"version-{version}")}
        resolve_weight_sync("disk")().load(engine, packed.payload, version)
        _same(engine.loads[-1][1], tensors)
    assert sorted(p.name for p in (tmp_path / "pushes").iterdir()) == ["version-2", "version-3"]


def test_an_engine_that_reads_files_itself_gets_the_path(tmp_path):
    class FileEngine:
        got = None

        def load_weights_from_disk(self, path, *, version):
            self.got = (path, version)

    engine = FileEngine()
    resolve_weight_sync("disk")().load(engine, {"weight_sync": "disk", "path": "/x/version-3"}, 3)
    assert engine.got == ("/x/version-3", 3)


def test_ipc_refuses_tensors_on_the_cpu():
    with pytest.raises(WeightSyncError, match=r"'a.weight' \(and 2 more\) lie on the CPU"):
        resolve_weight_sync("ipc")().pack(_tensors(), version=0)


def test_buckets_split_in_order_and_a_big_tensor_gets_its_own():
    tensors = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(100), "d": torch.zeros(1)}
    assert dist_group.plan_buckets(tensors, 80) == [["a", "b"], ["c"], ["d"]]
    assert dist_group.plan_buckets(tensors, 10 ** 6) == [["a", "b", "c", "d"]]
    spec = dist_group.spec_of(["a", "c"], tensors)
    assert spec == {"names": ["a", "c"], "dtypes": ["float32", "float32"], "shapes": [[10], [100]]}
    with pytest.raises(WeightSyncError, match="'x': dtype 'int64'"):
        dist_group.check_spec({"names": ["x"], "dtypes": ["int64"], "shapes": [[1]]})


@pytest.mark.parametrize("flags, message", [
    ({"weight-sync": "shm", "shm-pool-bytes": 0}, "--weight-sync shm with --shm-pool-bytes 0"),
    ({"weight-sync": "dist", "colocate": True}, "--weight-sync dist with --colocate"),
    ({"weight-sync": "ipc", "colocate": True, "device": "cuda"}, "--weight-sync ipc with --colocate"),
    ({"weight-sync": "ipc", "device": "cpu"}, "--weight-sync ipc on the CPU"),
    ({"weight-sync": "dist", "rollout-engine": "sglang",
      "sglang-urls": "http://127.0.0.1:1,http://127.0.0.1:2"}, "a spare server"),
    ({"weight-sync": "ipc", "rollout-engine": "sglang", "device": "cuda",
      "sglang-urls": "http://127.0.0.1:1"}, "--weight-sync ipc with --rollout-engine sglang"),
])
def test_what_cannot_work_is_refused_before_start(flags, message):
    with pytest.raises(ConfigError, match=message):
        build_config(flags)


def test_auto_is_the_shared_memory_pool_for_ipc_engines_else_frames():
    from replayrl.rollout.weight_sync.run_check import resolve, trainer_spec

    assert resolve(build_config({})) == "shm"
    assert resolve(build_config({"shm-pool-bytes": 0})) == "zmq"
    assert resolve(build_config({"weight-sync": "dist"})) == "dist"
    spec = trainer_spec(build_config({"weight-sync": "disk", "output-dir": "/tmp/run"}))
    assert spec == {"name": "disk", "settings": {"timeout_s": 300.0,
                                                 "directory": "/tmp/run/weight-sync"}}


def test_ipc_on_what_auto_resolved_is_refused_where_it_is_resolved():
    from replayrl.rollout.weight_sync.run_check import check_device

    check_device("ipc", "auto")  # not resolved yet: the launcher checks again
    check_device("ipc", "cuda", cuda_devices=1)
    with pytest.raises(RolloutConfigError, match="2 visible CUDA devices"):
        check_device("ipc", "cuda", cuda_devices=2)
    with pytest.raises(RolloutConfigError, match="on the CPU"):
        check_device("ipc", "cpu")
    check_device("dist", "cpu")
