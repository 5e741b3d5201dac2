"""The traces' wire bytes per trajectory token (``trace_bytes_per_token``, a metrics.jsonl key)
against a count made by hand from the codecs' documented layouts, before and after the
transport codec; a column in no wire form is an error naming it."""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.rollout.errors import SampleError
from replayrl.rollout.sample import Sample, samples_to_columns, trace_bytes_per_token
from replayrl.rollout.traces.trace_storage import wire_nbytes
from replayrl.transport.codec import Codec


def _sample(sid: int, P: int, R: int, indexer: list[list[int]] | None, width: int = 3) -> Sample:
    support = np.full((R, 1 + width), -1, np.int32)
    support[:, 0] = support[:, 1] = np.arange(R) + 2
    experts = (np.arange((P + R - 1) * 2 * 2) % 8).reshape(P + R - 1, 2, 2)  # ids 0..7, no -1
    return Sample(sample_id=sid, group_id=0, rollout_id=1, policy_version=0,
                  prompt_ids=np.arange(P) + 1, response_ids=support[:, 0].copy(),
                  loss_mask=np.ones(R, np.uint8), rollout_logprobs=np.full(R, -0.5),
                  reward=0.0, sample_support=support, routed_experts=experts,
                  indexer_topk=None if indexer is None else np.array(indexer).reshape(-1, 1, 2))


# one indexed layer keeping 2 keys; row p sees the p + 1 keys 0..p
A = _sample(0, 3, 2, [[0, -1],    # p 0: every key it sees -> "all", no bytes
                      [1, 0],     # p 1: every key (listed by score) -> "all"
                      [2, 0],     # p 2: 2 of 3 -> a 3-bit bitmap
                      [3, 1]])    # p 3: 2 of 4 -> a 4-bit bitmap
B = _sample(1, 2, 2, [[-1, -1],   # p 0: none -> "empty"
                      [0, -1],    # p 1: 1 of 2 -> a 2-bit bitmap
                      [1, 2]])    # p 2: 2 of 3 -> a 3-bit bitmap
TOKENS = (3 + 2) + (2 + 2)
SUPPORT = 4 * (1 + 3) * 4        # raw int32 [sum R, 1 + W]
ROUTING = 7 * 2 * 2 + 2          # uint8 ids of 7 rows x 2 layers x top-2, + 14 pad-row bits in 2 bytes
INDEXER = 7 + 4 * 2 + 2          # a kind byte per row, a uint16 count per bitmap row, 3+4+2+3 bits


def test_bytes_per_token_are_the_encoded_arrays_counted_by_hand():
    columns = samples_to_columns([A, B])
    want = {"sample_support_bytes_per_token": SUPPORT / TOKENS,
            "routed_experts_bytes_per_token": ROUTING / TOKENS,
            "indexer_topk_bytes_per_token": INDEXER / TOKENS,
            "trace_bytes_per_token": (SUPPORT + ROUTING + INDEXER) / TOKENS}
    assert trace_bytes_per_token(columns) == pytest.approx(want, rel=1e-12)
    # as the trainer receives them: through the transport codec, still encoded
    codec = Codec()
    assert trace_bytes_per_token(codec.decode(codec.encode(columns))) == pytest.approx(want, rel=1e-12)


def test_absent_and_per_sample_traces():
    wide = _sample(2, 2, 1, None, width=5)  # another support width: the column is a list
    columns = samples_to_columns([A, wide])
    assert isinstance(columns["sample_support"], list) and isinstance(columns["indexer_topk"], list)
    support = 2 * (1 + 3) * 4 + 1 * (1 + 5) * 4
    indexer = 4 * 1 * 2 * 4  # A's rows as raw int32 (a per-sample list is not encoded), wide's None
    got = trace_bytes_per_token(columns)  # 5 + 3 tokens
    assert got["sample_support_bytes_per_token"] == pytest.approx(support / 8)
    assert got["indexer_topk_bytes_per_token"] == pytest.approx(indexer / 8)
    no_index = trace_bytes_per_token(samples_to_columns([_sample(3, 2, 2, None)]))
    assert "indexer_topk_bytes_per_token" not in no_index  # a trace no sample carries has no key
    assert trace_bytes_per_token(samples_to_columns([])) == {}


def test_chunks_count_each_part():
    part = samples_to_columns([B])["indexer_topk"]
    assert wire_nbytes({"codec": "chunks", "rows": [3, 3], "parts": [part, np.zeros((3, 1, 2), np.int32)]}) \
        == (3 + 2 * 2 + 1) + 3 * 2 * 4  # B's 3 rows: kinds, 2 counts, 5 bits; a raw int32 part


def test_a_column_in_no_wire_form_is_named():
    columns = samples_to_columns([A])
    columns["routed_experts"] = "experts"
    with pytest.raises(SampleError, match="routed_experts"):
        trace_bytes_per_token(columns)
