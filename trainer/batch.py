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


@dataclass(frozen=True)
class TrainBatch:
    """A microbatch of ``B`` samples padded to ``T`` tokens, with ``N`` response tokens in all.

    Attributes:
        tokens: int64 [B, T]; position_ids: int64 [B, T]; key_padding_mask: bool [B, T].
        routed_experts: int64 [B, T, L_moe, K] or None (-1 rows = not replayed).
        indexer_topk: int64 [B, T, L_idx, K_idx] or None (-1 = no key).
        row, pos: int64 [N]: batch row (= sample index) and position whose logits predict each
            response token.
        targets: int64 [N] response token ids; support: int64 [N, 1+W] or None.
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
    routed_experts: torch.Tensor | None
    indexer_topk: torch.Tensor | None
    row: torch.Tensor
    pos: torch.Tensor
    targets: torch.Tensor
    support: torch.Tensor | None
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


def _carried(samples: Sequence[Sample], field: str) -> bool:
    """Whether the batch carries trace ``field``; all samples or none, else SampleError."""
    present = [getattr(s, field) is not None for s in samples]
    if any(present) and not all(present):
        missing = samples[present.index(False)]
        raise SampleError(missing.sample_id, field, "missing while other samples of the batch "
                                                    "carry it: replay would silently be partial")
    return all(present)


def _trace(samples: Sequence[Sample], field: str, T: int) -> torch.Tensor | None:
    if not _carried(samples, field):
        return None
    first = getattr(samples[0], field)
    out = np.full((len(samples), T) + first.shape[1:], -1, dtype=np.int64)
    for b, s in enumerate(samples):
        arr = getattr(s, field)
        if arr.shape[1:] != first.shape[1:]:
            raise SampleError(s.sample_id, field, f"row shape {arr.shape[1:]} != {first.shape[1:]} "
                                                  f"of sample {samples[0].sample_id}")
        out[b, : arr.shape[0]] = arr
    return torch.from_numpy(out)


def _response_fields(samples: Sequence[Sample], support: bool) -> dict:
    """Per-response-token tensors shared by both layouts, in sample order."""
    support_t = None
    if support:
        if any(s.sample_support is None for s in samples):
            bad = next(s for s in samples if s.sample_support is None)
            raise SampleError(bad.sample_id, "sample_support", "missing with support replay on")
        width = samples[0].sample_support.shape[1]
        for s in samples:
            if s.sample_support.shape[1] != width:
                raise SampleError(s.sample_id, "sample_support",
                                  f"{s.sample_support.shape[1]} columns, sample "
                                  f"{samples[0].sample_id} has {width}")
        support_t = torch.from_numpy(np.concatenate([s.sample_support for s in samples]).astype(np.int64))
    return dict(
        targets=torch.from_numpy(np.concatenate([s.response_ids for s in samples]).astype(np.int64)),
        support=support_t,
        loss_mask=torch.from_numpy(np.concatenate([s.loss_mask for s in samples]).astype(np.float32)),
        sampled_mask=torch.from_numpy(np.concatenate([s.sampled_mask for s in samples]).astype(np.float32)),
        rollout_logprobs=torch.from_numpy(np.concatenate([s.rollout_logprobs for s in samples])))


def collate_packed(samples: Sequence[Sample], *, routing: bool, indexer: bool, support: bool,
                   pad_to_multiple_of: int = 1) -> TrainBatch:
    """Pack ``samples`` into ONE row through a single :class:`replayrl.trainer.packing.PackedLayout`.

    Tokens, traces (routing rows, indexer key slots shifted to packed positions) and the
    positions predicting each response token all come from the same layout, so they cannot
    drift apart. Position ids restart per segment and ``segment_ids`` keeps attention inside
    each sample. The per-response-token fields are in the same order as :func:`collate`'s.

    Raises:
        SampleError / replayrl.trainer.packing.PackedFieldError: as :func:`collate`, naming the sample.
    """
    from replayrl.trainer.packing import PackedLayout

    if not samples:
        raise ValueError("collate_packed needs at least one sample")
    layout = PackedLayout.from_lengths([s.total_length for s in samples],
                                       pad_to_multiple_of=pad_to_multiple_of,
                                       sample_ids=[s.sample_id for s in samples])
    starts = layout.cu_seqlens_padded[:-1]
    pos = np.concatenate([start + len(s.prompt_ids) - 1 + np.arange(len(s.response_ids))
                          for start, s in zip(starts, samples)])

    def trace(field: str, key_slots: bool) -> torch.Tensor | None:
        if not _carried(samples, field):
            return None
        arrays = [getattr(s, field) for s in samples]
        pack = layout.pack_key_slots if key_slots else layout.pack
        kwargs = {"field": field, "offsets": [0] * len(arrays)}
        packed = pack(arrays, **kwargs) if key_slots else pack(arrays, -1, **kwargs)
        return torch.tensor(np.asarray(packed), dtype=torch.int64)[None]

    return TrainBatch(
        tokens=torch.from_numpy(np.asarray(layout.pack([s.tokens for s in samples], 0, field="tokens"),
                                           dtype=np.int64))[None],
        position_ids=torch.tensor(np.asarray(layout.position_ids), dtype=torch.int64)[None],
        key_padding_mask=torch.from_numpy(np.array(layout.real_mask))[None],
        routed_experts=trace("routed_experts", False) if routing else None,
        indexer_topk=trace("indexer_topk", True) if indexer else None,
        row=torch.zeros(len(pos), dtype=torch.int64), pos=torch.from_numpy(pos.astype(np.int64)),
        segment_ids=torch.tensor(np.asarray(layout.segment_ids), dtype=torch.int64)[None],
        **_response_fields(samples, support))


def collate(samples: Sequence[Sample], *, routing: bool, indexer: bool, support: bool) -> TrainBatch:
    """Build a :class:`TrainBatch`; ``routing`` / ``indexer`` / ``support`` select the traces.

    Raises:
        SampleError: a selected trace is missing on some sample or has a different row shape.
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
    return TrainBatch(
        tokens=torch.from_numpy(tokens),
        position_ids=torch.arange(T).expand(B, T).clone(),
        key_padding_mask=torch.from_numpy(mask),
        routed_experts=_trace(samples, "routed_experts", T) if routing else None,
        indexer_topk=_trace(samples, "indexer_topk", T) if indexer else None,
        row=torch.from_numpy(np.concatenate(rows)),
        pos=torch.from_numpy(np.concatenate(pos)),
        **_response_fields(samples, support),
    )
