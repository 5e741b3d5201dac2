"""``replayrl bench gpu``: which steps the plan runs or skips, and why, on a machine with CUDA and
on one without; the dry run's text; and the in-process steps on the CPU, whose figures are
checked against values computed here (the CUDA run itself: docs/gpu.md)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from replayrl.rollout.model.config import embedded_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.bench import gpu
from replayrl.tools.bench.gpu import STEPS, Environment, GpuCheck, describe, plan, push_config
from tests.paths import REPO

GPU_MACHINE = Environment(python="3.12.3", torch="2.11.0+cu130", cuda_build="13.0", cuda=True, absent="",
                          devices=("NVIDIA H100 80GB HBM3",), capability="9.0", bf16=True, nccl=True,
                          memory_gib=79.2, tests="/repo/tests", pytest="8.4.0")
CPU_MACHINE = Environment(python="3.11.7", torch="2.13.0+cpu", cuda_build=None, cuda=False,
                          absent="torch 2.13.0+cpu is a CPU-only build", tests="/repo/tests", pytest="8.4.0")


def _runs(steps) -> list[str]:
    return [s.name for s in steps if s.runs]


def test_on_a_gpu_machine_every_step_runs_within_a_ten_minute_call():
    steps = plan(GPU_MACHINE, "cuda")
    assert _runs(steps) == ["placement", "parity", "push", "generation", "trainer", "train-run", "gpu-tests"]
    assert all(s.why == "" and s.budget_s > 0 for s in steps)
    assert sum(s.budget_s for s in steps) <= 10 * 60


def test_without_cuda_every_cuda_step_is_skipped_with_the_reason():
    steps = plan(CPU_MACHINE, "cuda")
    assert _runs(steps) == []
    assert {s.why for s in steps} == {"needs a CUDA device: torch 2.13.0+cpu is a CPU-only build"}
    assert sum(s.budget_s for s in steps) == 0


def test_on_the_cpu_every_step_but_the_gpu_tests_runs():
    steps = plan(CPU_MACHINE, "cpu")
    assert _runs(steps) == ["placement", "parity", "push", "generation", "trainer", "train-run"]
    assert steps[-1].why == "the gpu tests need a CUDA device (--device cpu: they would all skip)"


@pytest.mark.parametrize("change, why", [
    ({"tests": ""}, "no tests/ folder beside the package (an installed wheel, not a checkout)"),
    ({"pytest": ""}, "pytest is not installed"),
])
def test_the_gpu_tests_need_the_checkout_and_pytest(change, why):
    steps = plan(dataclasses.replace(GPU_MACHINE, **change), "cuda")
    assert _runs(steps) == ["placement", "parity", "push", "generation", "trainer", "train-run"]
    assert steps[-1].why == why


def test_a_selection_skips_the_others_and_a_bad_one_is_refused():
    steps = plan(GPU_MACHINE, "cuda", ["push", "parity"])
    assert _runs(steps) == ["parity", "push"]  # in the fixed order
    assert {s.why for s in steps if not s.runs} == {"not selected (--steps)"}
    with pytest.raises(ValueError, match=r"no such step\(s\) \['pushh'\]"):
        plan(GPU_MACHINE, "cuda", ["pushh"])
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        plan(GPU_MACHINE, "auto")


def test_the_dry_run_names_the_build_each_step_and_what_a_gpu_would_run():
    text = describe(CPU_MACHINE, "cuda", plan(CPU_MACHINE, "cuda"))
    assert "torch 2.13.0+cpu (CPU-only build)" in text
    assert "CUDA: absent (torch 2.13.0+cpu is a CPU-only build)" in text
    for name in STEPS:
        assert f"  {name:<10}  skip: needs a CUDA device" in text
    assert "0 of 7 steps run; budget 0 s" in text
    total = sum(budget for _, budget in STEPS.values())
    assert f"on a CUDA machine --device cuda: 7 steps, budget {total} s" in text
    text = describe(GPU_MACHINE, "cuda", plan(GPU_MACHINE, "cuda"))
    assert "torch 2.11.0+cu130 (CUDA 13.0 build)" in text and "1 x NVIDIA H100 80GB HBM3" in text
    assert "on a CUDA machine" not in text


def test_the_dry_run_exits_0_here(capsys):
    assert gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("replayrl bench gpu --device cuda: the plan on this machine")
    assert all(name in out for name in STEPS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_check_itself_refuses_to_start(capsys, tmp_path):
    assert gpu.main(["--output-dir", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()


def test_the_push_model_has_about_a_billion_parameters():
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(push_config("1b", len(VOCABULARY)))
    assert 0.9e9 < sum(p.numel() for p in model.parameters()) < 1.1e9
    with pytest.raises(ValueError, match="--push-size must be one of"):
        push_config("2b", len(VOCABULARY))


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    return GpuCheck("cpu", "1m", "1m", tmp_path_factory.mktemp("gpu"), seed=1)


def test_on_the_cpu_replays_leave_no_flip(cpu_check):
    result = cpu_check.run_step("parity")
    assert result.ok and not result.error
    f = result.figures
    assert f["routing_flips"] == 0.0 and f["indexer_flips"] == 0.0
    assert f["samples"] == 64 and f["compute_dtype"] == "None"  # fp32 on the CPU
    assert 0 < f["mean_abs_dlogp"] <= f["max_abs_dlogp"]  # a bf16 engine against an fp32 trainer


def test_on_the_cpu_the_push_moves_every_weight(cpu_check):
    result = cpu_check.run_step("push")
    assert result.ok, result.error
    with torch.device("meta"):
        count = sum(p.numel() for p in Qwen3MoeForCausalLM(embedded_config(len(VOCABULARY), "1m")).parameters())
    assert result.figures["parameters"] == count == 913_280
    assert result.figures["gigabytes"] == pytest.approx(count * 4 / 1e9)
    assert result.figures["push_seconds"] == pytest.approx(
        result.figures["pack_seconds"] + result.figures["load_seconds"])


@pytest.mark.parametrize("step", ["generation", "trainer"])
def test_on_the_cpu_the_throughput_steps_count_tokens(cpu_check, step):
    result = cpu_check.run_step(step)
    assert result.ok, result.error
    assert result.figures["tokens_per_second"] > 0 and result.seconds > 0 and result.peak_mib > 0


def test_the_gpu_tests_step_collects_only_the_files_that_hold_gpu_tests(tmp_path):
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "unit" / "test_marked.py").write_text("@pytest.mark.gpu\ndef test_a(): ...\n")
    (tests / "unit" / "test_devices.py").write_text("from tests.devices import DEVICES\n")
    (tests / "unit" / "test_plain.py").write_text("def test_b(): ...\n")
    (tests / "unit" / "helper.py").write_text("@pytest.mark.gpu\n")
    assert gpu.gpu_test_files(tests) == ["tests/unit/test_devices.py", "tests/unit/test_marked.py"]
    here = gpu.gpu_test_files(REPO / "tests")
    assert "tests/unit/trainer/test_device_placement.py" in here
    assert "tests/unit/tools/test_bench_gpu.py" not in here
