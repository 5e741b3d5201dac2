"""Adding a trace is one row of rollout/traces/trace_table.py: a fake position-row trace added to the
table (and the modules that build their dataclasses from it imported afresh, as a new row would
be at import) is checked by Sample, travels in the column forms, is padded by truncation, the
synthetic EOS and the trainer batch, and is required when its replay is on. Expected values
are written out by hand."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from replayrl.rollout import sample as real_sample
from replayrl.rollout.traces import trace_table
from replayrl.rollout.traces.trace_table import TraceSpec

ROOT = Path(real_sample.__file__).resolve().parent.parent
SINKS = TraceSpec("attention_sinks", np.int32, ("L_sink",), "position", -1, "sinks",
                  "--use-sink-replay", "use_sink_replay", "sink_layers", "attention_sinks")


def _fresh(monkeypatch, relative: str) -> ModuleType:
    """A new copy of the module at ``relative`` (built from the patched table)."""
    name = "fake_trace_table_" + relative.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def mods(monkeypatch):
    monkeypatch.setattr(trace_table, "TRACES", (*trace_table.TRACES, SINKS))
    return SimpleNamespace(sample=_fresh(monkeypatch, "rollout/sample.py"),
                           trajectory=_fresh(monkeypatch, "rollout/traces/trajectory.py"),
                           engines=_fresh(monkeypatch, "rollout/engines/base.py"),
                           batch=_fresh(monkeypatch, "trainer/batching/batch.py"))


def _sample(mods, sid, prompt, response, sinks):
    return mods.sample.Sample(sample_id=sid, group_id=0, rollout_id=0, policy_version=0,
                              prompt_ids=prompt, response_ids=response,
                              loss_mask=np.ones(len(response), np.uint8),
                              rollout_logprobs=np.full(len(response), -0.5, np.float32),
                              attention_sinks=sinks)


def test_sample_checks_the_new_trace(mods):
    # P = 2, R = 2: position rows P + R - 1 = 3
    s = _sample(mods, 4, [1, 2], [3, 4], [[0, 1], [2, 3], [4, -1]])
    assert s.attention_sinks.dtype == np.int32 and s.attention_sinks.tolist() == [[0, 1], [2, 3], [4, -1]]
    assert not s.attention_sinks.flags.writeable
    with pytest.raises(mods.sample.SampleError, match=r"sample 5: field 'attention_sinks': 2 rows, "
                                                      r"expected 3 \(P=2, R=2\)"):
        _sample(mods, 5, [1, 2], [3, 4], [[0, 1], [2, 3]])
    with pytest.raises(mods.sample.SampleError, match="sample 6: field 'attention_sinks': expected 2-d"):
        _sample(mods, 6, [1, 2], [3, 4], [0, 1, 2])
    with pytest.raises(mods.sample.SampleError, match="sample 7: field 'attention_sinks': dtype float64"):
        _sample(mods, 7, [1, 2], [3, 4], np.zeros((3, 2)))
    assert "attention_sinks" in mods.sample.Sample.from_dict(s.to_dict()).to_dict()


def test_required_when_its_replay_is_on(mods):
    cfg = SimpleNamespace(moe_layers=(), indexed_layers=(), sink_layers=(0,))
    assert mods.sample.required_traces(cfg, sinks_replay=True) == ("attention_sinks",)
    assert mods.sample.required_traces(cfg, sinks_replay=False, support_replay=True) == ("sample_support",)
    no_layers = SimpleNamespace(moe_layers=(), indexed_layers=(), sink_layers=())
    assert mods.sample.required_traces(no_layers, sinks_replay=True) == ()


def test_column_form_carries_the_new_trace(mods):
    a = _sample(mods, 1, [1, 2], [3], [[1, 2], [3, 4]])          # P + R - 1 = 2 rows
    b = _sample(mods, 2, [5], [6, 7], [[5, 6], [7, 8]])          # P + R - 1 = 2 rows
    cols = mods.sample.samples_to_columns([a, b])
    assert cols["attention_sinks"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    for col in cols.values():
        if isinstance(col, np.ndarray):
            col.flags.writeable = False
    back = mods.sample.samples_from_columns(cols)
    assert [s.attention_sinks.tolist() for s in back] == [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    short = {**cols, "attention_sinks": np.zeros((3, 2), np.int32)}
    with pytest.raises(mods.sample.SampleError, match="'attention_sinks'.*does not hold the 4 rows"):
        mods.sample.samples_from_columns(short)
    del cols["attention_sinks"]
    with pytest.raises(mods.sample.SampleError, match="'attention_sinks'.*missing column"):
        mods.sample.samples_from_columns(cols)


def test_generation_columns_carry_the_new_trace(mods):
    gens = [mods.engines.Generation(response_ids=np.array([3, 4], np.int32),
                                    rollout_logprobs=np.array([-1.0, -2.0], np.float32),
                                    attention_sinks=np.array([[0], [1], [2]], np.int32),
                                    finish_reason="stop")]
    cols = mods.engines.generations_to_columns(gens)
    assert cols["trace_lengths"].tolist() == [3] and cols["attention_sinks"].tolist() == [[0], [1], [2]]
    assert mods.engines.generations_from_columns(cols)[0].attention_sinks.tolist() == [[0], [1], [2]]


def test_truncation_and_synthetic_eos_pad_the_new_trace(mods):
    s = _sample(mods, 3, [1, 2], [3, 4, 5], [[0, 0], [1, 1], [2, 2], [3, 3]])
    cut = mods.trajectory.truncate(s, 1)  # P + 1 - 1 = 2 rows kept
    assert cut.attention_sinks.tolist() == [[0, 0], [1, 1]]
    eos = mods.trajectory.append_synthetic_eos(cut, 9)  # one -1 row for the unforwarded token
    assert eos.attention_sinks.tolist() == [[0, 0], [1, 1], [-1, -1]]


def test_merge_turns_takes_each_position_from_its_first_forward(mods):
    # turn 0: context [1, 2], response [3, 4] -> positions 0..2; observation [5];
    # turn 1: context [1, 2, 3, 4, 5], response [6] -> positions 0..4, of which 3, 4 are new
    turns = [dict(response_ids=[3, 4], rollout_logprobs=[-1.0, -1.0], finish_reason="stop",
                  attention_sinks=[[10], [11], [12]]),
             dict(response_ids=[6], rollout_logprobs=[-1.0], finish_reason="stop",
                  attention_sinks=[[20], [21], [22], [23], [24]])]
    merged = mods.trajectory.merge_turns([1, 2], turns, [[5]], sample_id=1, require=("attention_sinks",))
    assert merged.attention_sinks.tolist() == [[10], [11], [12], [23], [24]]
    with pytest.raises(real_sample.MissingTraceError, match="sample 2: field 'attention_sinks'"):
        mods.trajectory.merge_turns([1, 2], [{**turns[0], "attention_sinks": None}], [],
                                    sample_id=2, require=("attention_sinks",))


def test_trainer_batch_pads_the_new_trace(mods):
    a = _sample(mods, 1, [1, 2], [3], [[1, 2], [3, 4]])        # 3 tokens, 2 rows
    b = _sample(mods, 2, [5], [6, 7, 8], [[5, 6], [7, 8], [9, 9]])  # 4 tokens, 3 rows
    batch = mods.batch.collate([a, b], sinks=True)
    assert batch.attention_sinks.dtype.is_floating_point is False
    assert batch.attention_sinks.tolist() == [[[1, 2], [3, 4], [-1, -1], [-1, -1]],
                                              [[5, 6], [7, 8], [9, 9], [-1, -1]]]
    assert mods.batch.collate([a, b]).attention_sinks is None  # not selected
    packed = mods.batch.collate_packed([a, b], sinks=True)  # one row: 3 + 4 tokens
    assert packed.attention_sinks.tolist() == [[[1, 2], [3, 4], [-1, -1],
                                                [5, 6], [7, 8], [9, 9], [-1, -1]]]
    with pytest.raises(TypeError, match="sink"):
        mods.batch.collate([a, b], sink=True)


def test_the_real_table_keeps_the_fields_where_they_were():
    from dataclasses import fields

    from replayrl.rollout.engines.base import Generation
    from replayrl.rollout.traces.trajectory import MergedTrajectory
    traces = ["sample_support", "routed_experts", "indexer_topk"]
    assert [f.name for f in fields(real_sample.Sample)] == [
        "sample_id", "group_id", "rollout_id", "policy_version", "prompt_ids", "response_ids",
        "loss_mask", "rollout_logprobs", "reward", "status", *traces, "synthetic_eos"]
    assert [f.name for f in fields(Generation)] == ["response_ids", "rollout_logprobs", *traces,
                                                    "finish_reason"]
    assert [f.name for f in fields(MergedTrajectory)] == [
        "response_ids", "loss_mask", "rollout_logprobs", *traces, "finish_reason", "num_turns",
        "dropped_turns"]
    assert real_sample.TRACE_FIELDS == tuple(traces)
