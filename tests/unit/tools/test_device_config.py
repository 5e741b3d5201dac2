"""``--device`` in the run's settings and the launcher: one flag sets the run's and the
trainer's field, ``cuda`` where torch sees none is refused before any process starts (and with
the megatron backend, whose CUDA placement is not written, everywhere), and on a machine with
several CUDA devices each trainer rank and engine process is given one."""
from __future__ import annotations

import pytest
import torch

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.initial_files import Resolved
from replayrl.tools.run.launcher import actor_specs, cuda_device_env, engine_kwargs, resolve_run_device

ENGINE = "replayrl.rollout.engines.embedded:EmbeddedEngine"


def test_one_flag_sets_the_run_and_the_trainer_device():
    assert (build_config({}).device, build_config({}).trainer.device) == ("auto", "auto")
    config = build_config({"device": "cpu"})
    assert (config.device, config.trainer.device) == ("cpu", "cpu")
    with pytest.raises(ConfigError, match="--device must be auto, cpu or cuda"):
        build_config({"device": "gpu"})


def test_cpu_resolves_to_the_cpu_on_any_machine():
    assert resolve_run_device(build_config({"device": "cpu"})) == ("cpu", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused_before_start():
    assert resolve_run_device(build_config({})) == ("cpu", 0)
    with pytest.raises(ConfigError, match=r"--device cuda, but torch sees no CUDA device \(torch "
                                          r".* is a CPU-only build\); use --device cpu or auto"):
        resolve_run_device(build_config({"device": "cuda"}))
    with pytest.raises(ConfigError, match="--device cuda"):  # the engine dtype resolves for it
        engine_kwargs(build_config({"device": "cuda"}))


def test_megatron_refuses_cuda_before_start():
    with pytest.raises(ConfigError, match="--train-backend megatron with --device cuda: the megatron "
                                          "backend trains on the CPU"):
        build_config({"train-backend": "megatron", "device": "cuda"})
    assert build_config({"train-backend": "megatron", "device": "cpu"}).trainer.device == "cpu"


def test_the_embedded_engine_gets_the_resolved_device():
    config = build_config({"device": "auto"})
    assert engine_kwargs(config, 0, "float32", "cuda")["device"] == "cuda"
    assert engine_kwargs(config, 0, "float32")["device"] == "auto"  # its process resolves it
    assert engine_kwargs(build_config({"device": "cpu"}))["dtype"] in ("float32", "bfloat16")


def _resolved(device: str, count: int) -> Resolved:
    return Resolved(ENGINE, "float32", "auto", device, count)


@pytest.mark.parametrize("settings, count, visible, expected", [
    ({"num-engines": 2}, 3, "", {"trainer": "0", "engine_0": "1", "engine_1": "2"}),
    ({"num-engines": 2, "dp-size": 2, "rollout-batch-size": 2}, 2, "",
     {"trainer": "0", "trainer_1": "1", "engine_0": "0", "engine_1": "1"}),
    # the launcher's own CUDA_VISIBLE_DEVICES: its ids are handed out
    ({"num-engines": 2}, 3, "4,6,7", {"trainer": "4", "engine_0": "6", "engine_1": "7"}),
    # a colocated engine_0 is the trainer's process: one device
    ({"num-engines": 2, "colocate": True}, 2, "", {"trainer": "0", "engine_0": "0", "engine_1": "0"}),
])
def test_each_process_sees_one_device_of_the_node(settings, count, visible, expected):
    config = build_config(settings)
    env = cuda_device_env(config, _resolved("cuda", count), visible=visible)
    assert env == {name: {"CUDA_VISIBLE_DEVICES": v} for name, v in expected.items()}


def test_one_device_or_the_cpu_sets_no_environment():
    config = build_config({"num-engines": 2})
    assert cuda_device_env(config, _resolved("cuda", 1), visible="") == {}
    assert cuda_device_env(config, _resolved("cpu", 0), visible="") == {}


def test_actor_specs_carry_the_device_and_the_visible_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = build_config({"num-engines": 2})
    specs = {s.name: s for s in actor_specs(config, "unused", resolved=_resolved("cuda", 2))}
    assert specs["engine_1"].kwargs["engine_kwargs"]["device"] == "cuda"
    assert [specs[n].env.get("CUDA_VISIBLE_DEVICES") for n in ("trainer", "engine_0", "engine_1")] == ["0", "1", "0"]
    assert "CUDA_VISIBLE_DEVICES" not in specs["rollout_manager"].env
    cpu = {s.name: s for s in actor_specs(config, "unused", resolved=_resolved("cpu", 0))}
    assert cpu["engine_0"].kwargs["engine_kwargs"]["device"] == "cpu"
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in cpu.values())
