"""The prefetched rollout a checkpoint holds: written and read back sample for sample (the
resumed run trains exactly what the interrupted one would have); a damaged file is refused."""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.rollout.dispatch.prefetched import read_prefetched, write_prefetched
from replayrl.rollout.errors import RolloutError
from replayrl.rollout.sample import Sample


def _sample(i: int, response: list[int]) -> Sample:
    R = len(response)
    return Sample(sample_id=10 + i, group_id=i // 2, rollout_id=3, policy_version=2,
                  prompt_ids=np.array([1, 2, 3 + i], np.int32),
                  response_ids=np.array(response, np.int32), loss_mask=np.ones(R, np.uint8),
                  rollout_logprobs=np.linspace(-1.0, -0.1, R, dtype=np.float32) * (i + 1),
                  reward=0.25 * i, status="truncated" if i == 3 else "completed",
                  routed_experts=np.arange((3 + R - 1) * 2 * 2, dtype=np.int32).reshape(-1, 2, 2) % 8)


def test_a_batch_comes_back_field_for_field_with_its_summary(tmp_path):
    samples = [_sample(i, [5, 6, 7][: 1 + i % 3]) for i in range(4)]
    summary = {"rollout_id": 3, "reward_mean": 0.375, "policy_versions": [2],
               "prompt_indices": [7, 1], "generate_seconds": 0.5}
    write_prefetched(tmp_path / "batch", 3, summary, samples)
    rollout_id, back_summary, back = read_prefetched(tmp_path / "batch")
    assert rollout_id == 3 and back_summary == summary
    assert len(back) == 4
    for a, b in zip(samples, back):
        for name in ("sample_id", "group_id", "rollout_id", "policy_version", "reward", "status",
                     "synthetic_eos"):
            assert getattr(a, name) == getattr(b, name)
        for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "routed_experts"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))  # bit for bit
            assert getattr(a, name).dtype == getattr(b, name).dtype
        assert b.sample_support is None and b.indexer_topk is None


def test_a_damaged_or_foreign_file_is_refused_naming_it(tmp_path):
    write_prefetched(tmp_path / "batch", 3, {}, [_sample(0, [5])])
    data = (tmp_path / "batch").read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 2])
    with pytest.raises(RolloutError, match="cut: not a prefetched rollout"):
        read_prefetched(tmp_path / "cut")
    (tmp_path / "other").write_bytes(b"\x81\xa1a\x01")  # msgpack {"a": 1}
    with pytest.raises(RolloutError, match=r"other: not a prefetched rollout \(keys \['a'\]\)"):
        read_prefetched(tmp_path / "other")


# -- the rollout manager's checkpoint state, in-process (tests/fake_engine.py's engine) ------
async def _manager(tmp_path, engine):
    from replayrl.rollout.dispatch.manager import RolloutManager
    from replayrl.tools.run.from_flags import build_config
    from replayrl.tools.run.launcher import run_required_traces, write_initial_checkpoint

    config = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "progress": False,
                           "output-dir": str(tmp_path)})
    checkpoint = tmp_path / "ckpt"
    if not checkpoint.exists():
        write_initial_checkpoint(config, checkpoint)
    model = config.policy_config
    manager = RolloutManager(config.rollout.to_dict(), ["engine_0"], run_required_traces(config),
                             model.max_position_embeddings, str(checkpoint), model.vocab_size)
    manager.proxy = lambda name, timeout=None: engine
    return manager


class _NoEngine:
    """Stands for an engine a restored rollout must not reach."""

    def __getattr__(self, name):
        raise AssertionError(f"the engine was asked to {name}")


def _columns_equal(a: dict, b: dict) -> None:
    """The batches of two ``take_batch`` results hold equal samples, field for field."""
    from replayrl.rollout.sample import samples_from_columns

    left, right = samples_from_columns(a), samples_from_columns(b)
    assert len(left) == len(right) == 4
    for x, y in zip(left, right):
        for name, value in x.to_dict().items():
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(value, getattr(y, name))
            else:
                assert value == getattr(y, name), name


async def test_a_checkpoint_of_a_prefetched_rollout_gives_that_batch_back_or_its_prompts_again(tmp_path):
    from replayrl.rollout.dispatch.engine_actor import EngineActor
    from replayrl.tools.run.from_flags import build_config
    from replayrl.tools.run.launcher import engine_kwargs, run_required_traces
    from replayrl.transport.array_bundle import pack_arrays

    config = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "progress": False,
                           "output-dir": str(tmp_path)})
    engine = EngineActor("tests.fake_engine:FixedDigitEngine", engine_kwargs(config),
                         run_required_traces(config))
    await engine.load_weights(0, pack_arrays({"w": np.zeros(3, np.float32)}))
    run = await _manager(tmp_path, engine)
    await run.generate(0, min_version=0)
    await run.take_batch(0)  # step 0 trained
    assert run.batches == {} and run.batch_columns == {}  # its columns left with it
    prefetched = await run.generate(1, min_version=0)  # generated while step 0 trained
    saved = tmp_path / "step-1"
    saved.mkdir()
    state = await run.state(1, str(saved))
    assert state["prefetched"]["rollout_id"] == 1 and (saved / state["prefetched"]["file"]).exists()

    resumed = await _manager(tmp_path, _NoEngine())
    await resumed.load_state(state, str(saved))
    assert await resumed.generate(1, min_version=1) == prefetched  # not generated again
    _columns_equal(await resumed.take_batch(1), await run.take_batch(1))
    # the data source continues after that draw: the next rollout's prompts are the run's
    resumed.proxy = lambda name, timeout=None: engine
    assert ((await resumed.generate(2, min_version=0))["prompt_indices"]
            == (await run.generate(2, min_version=0))["prompt_indices"])

    again = await _manager(tmp_path, engine)  # a synchronous resume cannot train it
    await again.load_state(state, str(saved), prefetched=False)
    assert (await again.generate(1, min_version=0))["prompt_indices"] == prefetched["prompt_indices"]
