"""Collate trajectories into right-padded trainer tensors, traces included.

Right padding keeps key slot == token position, so replayed indexer key positions need no
remapping, and causal attention makes pad columns invisible to real tokens. The logit at
position ``p`` predicts token ``p + 1``; response token ``j`` of a sample with prompt length
``P`` is therefore predicted at position ``P - 1 + j``. Trace rows cover positions
``0 .. P+R-2`` (the last token is never forwarded); every other row is ``-1``, which the model
treats as "no replay for this row".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from replayrl.rollout.sample import Sample, SampleError
from replayrl.rollout.traces import trace_table
from replayrl.rollout.traces.trace_table import TraceSpec, trace_fields


@dataclass(frozen=True)
@trace_fields(before="row", attr="batch_field")
class TrainBatch:
    """A microbatch of ``B`` samples padded to ``T`` tokens, with ``N`` response tokens in all.

    Attributes:
        tokens: int64 [B, T]; position_ids: int64 [B, T]; key_padding_mask: bool [B, T].
        One field per row of ``replayrl.rollout.traces.trace_table.TRACES`` (named by its
        ``batch_field``; keyword-only, default None = not collated): position-row traces int64
        ``[B, T, ...]``, rows past each sample's ``P + R - 1`` the trace's padding value, e.g.
        routed_experts: int64 [B, T, L_moe, K] or None (-1 rows = not replayed);
        indexer_topk: int64 [B, T, L_idx, K_idx] or None (-1 = no key); response-row traces
        int64 ``[N, ...]``, e.g. support: int64 [N, 1+W] or None.
        row, pos: int64 [N]: batch row (= sample index) and position whose logits predict each
            response token.
        targets: int64 [N] response token ids.
        loss_mask: float32 [N]; rollout_logprobs: float32 [N] (NaN allowed where mask is 0).
        sampled_mask: float32 [N]: ``loss_mask`` without the synthetic-EOS rows, i.e. the loss
            tokens the engine sampled and whose ``rollout_logprobs`` is a behaviour logprob
            (:attr:`replayrl.rollout.sample.Sample.sampled_mask`); equal to ``loss_mask`` when no sample
            carries a synthetic EOS.
        segment_ids: int64 [1, T] for a packed batch (one row, block-diagonal attention), else
            None.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    key_padding_mask: torch.Tensor
    row: torch.Tensor
    pos: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    sampled_mask: torch.Tensor
    segment_ids: torch.Tensor | None = None


def per_sample_tensors(samples: Sequence[Sample], field: str) -> list[torch.Tensor]:
    """One tensor per sample of a per-token field (copies: sample arrays are read-only)."""
    return [torch.from_numpy(np.array(getattr(s, field))) for s in samples]


def sampled_masks(samples: Sequence[Sample]) -> list[torch.Tensor]:
    """One uint8 tensor [R_i] per sample: :attr:`replayrl.rollout.sample.Sample.sampled_mask`, the loss
    tokens the engine sampled (what every RS gate and TIS weight reads; the synthetic EOS row and
    observation rows are 0)."""
    return [torch.from_numpy(np.array(s.sampled_mask)) for s in samples]


def token_counts(samples: Sequence[Sample], token_accept: dict[int, torch.Tensor]) -> tuple[int, int]:
    """``(loss tokens, loss tokens the RS gate accepted)`` over ``samples``.

    ``token_accept`` maps sample id -> bool [R] from
    :meth:`replayrl.trainer.rejection.rs_policy.RSGate.decide`.
    """
    if not samples:
        return 0, 0
    # one concatenation instead of a tensor per sample: the counts are the same integers
    mask = np.concatenate([s.loss_mask for s in samples]) > 0
    accept = torch.cat([token_accept[s.sample_id] for s in samples]).numpy()
    return int(mask.sum()), int((accept & mask).sum())


def _selected(selected: dict[str, bool]) -> list[TraceSpec]:
    """The table rows ``collate``'s keywords select (keyword = ``TraceSpec.replay``).

    Raises:
        TypeError: a keyword naming no trace.
    """
    rows = trace_table.TRACES
    unknown = sorted(set(selected) - {row.replay for row in rows})
    if unknown:
        raise TypeError(f"collate: unknown trace keyword {unknown[0]!r}; known: "
                        f"{[row.replay for row in rows]}")
    return [row for row in rows if selected.get(row.replay, False)]


def _carried(samples: Sequence[Sample], field: str) -> bool:
    """Whether the batch carries trace ``field``; all samples or none, else SampleError."""
    present = [getattr(s, field) is not None for s in samples]
    if any(present) and not all(present):
        missing = samples[present.index(False)]
        raise SampleError(missing.sample_id, field, "missing while other samples of the batch "
                                                    "carry it: replay would silently be partial")
    return all(present)


def _same_row_shape(samples: Sequence[Sample], field: str) -> list[np.ndarray]:
    """Every sample's ``field`` array; SampleError naming the first with another row shape."""
    arrays = [getattr(s, field) for s in samples]
    for s, arr in zip(samples, arrays):
        if arr.shape[1:] != arrays[0].shape[1:]:
            raise SampleError(s.sample_id, field, f"row shape {arr.shape[1:]} != "
                                                  f"{arrays[0].shape[1:]} of sample {samples[0].sample_id}")
    return arrays


def _position_trace(samples: Sequence[Sample], row: TraceSpec, T: int) -> torch.Tensor | None:
    """int64 [B, T, ...]: each sample's rows, then ``row.pad``; None when no sample has it."""
    if not _carried(samples, row.name):
        return None
    arrays = _same_row_shape(samples, row.name)
    out = np.full((len(samples), T) + arrays[0].shape[1:], row.pad, dtype=np.int64)
    for b, arr in enumerate(arrays):
        out[b, : arr.shape[0]] = arr
    return torch.from_numpy(out)


def _response_trace(samples: Sequence[Sample], row: TraceSpec) -> torch.Tensor:
    """int64 [N, ...]: the samples' rows concatenated; every sample must carry it."""
    for s in samples:
        if getattr(s, row.name) is None:
            raise SampleError(s.sample_id, row.name, f"missing with {row.replay} replay on")
    return torch.from_numpy(np.concatenate(_same_row_shape(samples, row.name)).astype(np.int64))


def _response_fields(samples: Sequence[Sample], traces: Sequence[TraceSpec]) -> dict:
    """Per-response-token tensors shared by both layouts, in sample order (the selected
    response-row traces included, by their batch field)."""
    return dict(
        targets=torch.from_numpy(np.concatenate([s.response_ids for s in samples]).astype(np.int64)),
        **{row.batch_field: _response_trace(samples, row) for row in traces
           if row.rows == "response"},
        loss_mask=torch.from_numpy(np.concatenate([s.loss_mask for s in samples]).astype(np.float32)),
        sampled_mask=torch.from_numpy(np.concatenate([s.sampled_mask for s in samples]).astype(np.float32)),
        rollout_logprobs=torch.from_numpy(np.concatenate([s.rollout_logprobs for s in samples])))


def collate_packed(samples: Sequence[Sample], *, pad_to_multiple_of: int = 1,
                   **selected: bool) -> TrainBatch:
    """Pack ``samples`` into ONE row through a single :class:`replayrl.trainer.batching.packing.PackedLayout`.

    Tokens, traces (routing rows, indexer key slots shifted to packed positions) and the
    positions predicting each response token all come from the same layout, so they cannot
    drift apart. Position ids restart per segment and ``segment_ids`` keeps attention inside
    each sample. The per-response-token fields are in the same order as :func:`collate`'s.
    ``selected`` as :func:`collate`'s.

    Raises:
        SampleError / replayrl.trainer.batching.packing.PackedFieldError: as :func:`collate`, naming the sample.
    """
    from replayrl.trainer.batching.packing import PackedLayout

    if not samples:
        raise ValueError("collate_packed needs at least one sample")
    layout = PackedLayout.from_lengths([s.total_length for s in samples],
                                       pad_to_multiple_of=pad_to_multiple_of,
                                       sample_ids=[s.sample_id for s in samples])
    starts = layout.cu_seqlens_padded[:-1]
    pos = np.concatenate([start + len(s.prompt_ids) - 1 + np.arange(len(s.response_ids))
                          for start, s in zip(starts, samples)])

    def trace(row: TraceSpec) -> torch.Tensor | None:
        if not _carried(samples, row.name):
            return None
        arrays = [getattr(s, row.name) for s in samples]
        kwargs = {"field": row.name, "offsets": [0] * len(arrays)}
        packed = (layout.pack_key_slots(arrays, **kwargs) if row.key_slots
                  else layout.pack(arrays, row.pad, **kwargs))
        return torch.tensor(np.asarray(packed), dtype=torch.int64)[None]

    traces = _selected(selected)
    positions = {row.batch_field: trace(row) for row in traces if row.rows == "position"}

    return TrainBatch(
        tokens=torch.from_numpy(np.asarray(layout.pack([s.tokens for s in samples], 0, field="tokens"),
                                           dtype=np.int64))[None],
        position_ids=torch.tensor(np.asarray(layout.position_ids), dtype=torch.int64)[None],
        key_padding_mask=torch.from_numpy(np.array(layout.real_mask))[None],
        **positions,
        row=torch.zeros(len(pos), dtype=torch.int64), pos=torch.from_numpy(pos.astype(np.int64)),
        segment_ids=torch.tensor(np.asarray(layout.segment_ids), dtype=torch.int64)[None],
        **_response_fields(samples, traces))


def collate(samples: Sequence[Sample], **selected: bool) -> TrainBatch:
    """Build a :class:`TrainBatch`; keywords select the traces.

    Args:
        selected: ``<replay>=bool`` per row of ``trace_table.TRACES`` (``routing``,
            ``indexer``, ``support``); a trace without its keyword is not collated. A selected
            position-row trace is None when no sample carries it (and an error when only some
            do); a selected response-row trace must be on every sample.

    Raises:
        SampleError: a selected trace is missing on some sample or has a different row shape.
        TypeError: a keyword naming no trace.
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    B, T = len(samples), max(s.total_length for s in samples)
    tokens = np.zeros((B, T), np.int64)
    mask = np.zeros((B, T), bool)
    rows, pos = [], []
    for b, s in enumerate(samples):
        P, L = len(s.prompt_ids), s.total_length
        tokens[b, :L] = s.tokens
        mask[b, :L] = True
        R = len(s.response_ids)
        rows.append(np.full(R, b))
        pos.append(np.arange(P - 1, P - 1 + R))
    traces = _selected(selected)
    return TrainBatch(
        tokens=torch.from_numpy(tokens),
        position_ids=torch.arange(T).expand(B, T).clone(),
        key_padding_mask=torch.from_numpy(mask),
        **{row.batch_field: _position_trace(samples, row, T) for row in traces
           if row.rows == "position"},
        row=torch.from_numpy(np.concatenate(rows)),
        pos=torch.from_numpy(np.concatenate(pos)),
        **_response_fields(samples, traces),
    )
