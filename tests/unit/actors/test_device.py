"""``--device``: each decision of replayrl.actors.device for both inputs (CUDA present or not)
on any machine, and the device a process gets on the devices this machine has."""
from __future__ import annotations

import pytest
import torch

from replayrl.actors.device import (
    DEVICES,
    compute_dtype,
    cuda_absent_reason,
    cuda_slots,
    device_index,
    pins_host_memory,
    process_device,
    resolve_device_kind,
)
from replayrl.actors.errors import DeviceError
from tests.devices import DEVICES as TEST_DEVICES


@pytest.mark.parametrize("name, cuda, kind", [
    ("auto", True, "cuda"), ("auto", False, "cpu"),
    ("cpu", True, "cpu"), ("cpu", False, "cpu"),
    ("cuda", True, "cuda"),
])
def test_the_device_kind_follows_the_name_and_the_machine(name, cuda, kind):
    assert resolve_device_kind(name, cuda) == kind


def test_cuda_without_cuda_is_refused_naming_the_flag_and_the_reason():
    with pytest.raises(DeviceError, match=r"--device cuda, but torch sees no CUDA device "
                                          r"\(a CPU build\); use --device cpu or auto"):
        resolve_device_kind("cuda", False, "a CPU build")


def test_an_unknown_device_is_refused():
    with pytest.raises(DeviceError, match="--device must be one of"):
        resolve_device_kind("gpu", True)
    assert DEVICES == ("auto", "cpu", "cuda")


@pytest.mark.parametrize("local_rank, visible, index", [(0, 1, 0), (3, 1, 0), (3, 4, 3), (5, 4, 1)])
def test_a_process_takes_its_local_rank_modulo_the_visible_devices(local_rank, visible, index):
    assert device_index(local_rank, visible) == index


def test_no_visible_device_or_a_negative_rank_is_refused():
    with pytest.raises(DeviceError, match="no CUDA device visible"):
        device_index(0, 0)
    with pytest.raises(DeviceError, match="LOCAL_RANK must be >= 0"):
        device_index(-1, 2)


def test_bf16_compute_only_on_a_cuda_device_that_has_it():
    assert compute_dtype(torch.device("cpu")) is None
    assert compute_dtype(torch.device("cpu"), bf16_supported=True) is None
    assert compute_dtype(torch.device("cuda", 0), bf16_supported=True) is torch.bfloat16
    assert compute_dtype(torch.device("cuda", 0), bf16_supported=False) is None


def test_host_memory_is_pinned_only_for_a_cuda_device():
    assert pins_host_memory(torch.device("cpu")) is False
    assert pins_host_memory(torch.device("cuda", 1)) is True


def test_trainer_ranks_then_engines_share_out_the_devices():
    trainers, engines = ["trainer", "trainer_1"], ["engine_0", "engine_1"]
    assert cuda_slots(trainers, engines, 4) == {"trainer": 0, "trainer_1": 1, "engine_0": 2, "engine_1": 3}
    assert cuda_slots(trainers, engines, 3) == {"trainer": 0, "trainer_1": 1, "engine_0": 2, "engine_1": 0}
    assert set(cuda_slots(trainers, engines, 1).values()) == {0}
    # a colocated engine_0 shares the trainer's process, so its device
    assert cuda_slots(["trainer"], ["engine_0", "engine_1"], 3, shared=["engine_0", "version_clock"]) == {
        "trainer": 0, "engine_0": 0, "engine_1": 2}
    with pytest.raises(DeviceError):
        cuda_slots(trainers, engines, 0)


def test_cpu_is_the_cpu_whatever_local_rank_says():
    assert process_device("cpu", {"LOCAL_RANK": "not a number"}) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused_with_the_reason():
    assert process_device("auto") == torch.device("cpu")
    reason = cuda_absent_reason()
    assert reason and torch.__version__ in reason
    with pytest.raises(DeviceError, match="--device cuda, but torch sees no CUDA device"):
        process_device("cuda")


@pytest.mark.parametrize("device", TEST_DEVICES)
def test_a_process_gets_a_device_of_the_kind_asked(device):
    got = process_device(device, {"LOCAL_RANK": "0"})
    assert got.type == device
    if device == "cuda":
        assert got.index == 0 and torch.cuda.current_device() == 0


@pytest.mark.gpu
def test_a_malformed_local_rank_is_refused_on_cuda():
    with pytest.raises(DeviceError, match="LOCAL_RANK must be an integer"):
        process_device("cuda", {"LOCAL_RANK": "x"})
