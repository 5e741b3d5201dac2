"""The embedded generation engine: batched sampling from the embedded model with a KV cache.

The engine runs :class:`replayrl.rollout.model.qwen3_moe.Qwen3MoeForCausalLM` in the rollout dtype
(bf16 by default; the trainer runs fp32, so a real train-inference mismatch exists,
docs/design/model.md#embedded-default) and records, for every generated turn, the traces it is asked for among the
three the trainer replays: the sampler support (``sample_support``), the MoE routing
(``routed_experts``, R3) and the sparse-attention indexer choices (``indexer_topk``). It is the
first implementation of :class:`replayrl.rollout.engines.base.Engine` (registry name ``"embedded"``).

Batching: all prompts of a call are left-padded to the longest one; each distinct padded prompt
is prefilled once and its cache rows shared by every row that repeats it (a prompt group). The padding is masked out
of attention by ``key_padding_mask`` and every row's ``position_ids`` count ``0..`` over its real
tokens, so a row's math is that of the same trajectory forwarded alone. A model whose rows must
start at slot 0 (``aligned_rows``: DeepSeek-V4 compresses keys in windows counted from slot 0)
decodes each group of equal-length prompts as a batch of its own, with no padding. Prefill runs once, then
one decode step per new token feeds the last sampled token of every row through the KV cache.
A row that sampled EOS is finished: it keeps being fed a pad token (masked out as a key), and
whatever it computes is discarded.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from replayrl.actors.device import DEVICES, process_device
from replayrl.rollout.engines.base import Engine, Generation
from replayrl.rollout.errors import EngineError, EngineInputError
from replayrl.rollout.model.adapters import AdapterMerge, split_adapter_push
from replayrl.rollout.model.checkpoint import load_state_arrays
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.families.base import FamilyConfig, FamilyModel
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sample import TRACE_FIELDS
from replayrl.rollout.sampling.sampler import sample
from replayrl.rollout.sampling.sampling_params import SamplingParams

__all__ = ["EmbeddedEngine"]

# Token fed in padding slots and to finished rows; any in-vocabulary id works since those
# slots are masked out as keys and their outputs are discarded.
_PAD_FEED_ID = 0


def _read_only(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    arr = np.ascontiguousarray(t.detach().cpu().numpy(), dtype=dtype)
    if not arr.flags.owndata:
        arr = arr.copy()  # never expose a view of an engine buffer
    arr.flags.writeable = False
    return arr


class EmbeddedEngine(Engine):
    """Batched generation with the embedded Qwen3-MoE model, capturing all replay traces.

    Args:
        model_config: the model shape, a :class:`replayrl.rollout.model.config.ModelConfig` or its
            fields as a dict (HF names; how the engine actor passes it), or a family's
            :class:`replayrl.rollout.model.families.base.FamilyConfig` (its dict has ``family``):
            then the model is transformers' (rollout/model/families/), its cache a DynamicCache.
        dtype: compute and weight dtype of the rollout model, a floating ``torch.dtype`` or its
            name (``"bfloat16"``, default: a real train-inference mismatch; ``"float32"``).
        device: where the model and its KV cache live: a torch device (``"cuda:1"``), or a
            ``--device`` name (``"auto"``, ``"cpu"``, ``"cuda"``) resolved for this process by
            :func:`replayrl.actors.device.process_device` (its CUDA device, made current).

    The model starts with uninitialised weights and :attr:`version` ``None``; ``generate`` raises
    :class:`replayrl.rollout.engines.base.EngineNotReady` until :meth:`load_weights` succeeded once.
    ``routed_experts`` / ``indexer_topk`` are ``None`` when requested on a model without MoE /
    indexed layers.

    Raises:
        EngineInputError: ``dtype`` is not a floating torch dtype (or the name of one).
        replayrl.actors.errors.DeviceError: ``device`` is ``"cuda"`` where torch sees no CUDA
            device.
    """

    capturable_traces = frozenset(TRACE_FIELDS)

    def __init__(
        self,
        model_config: ModelConfig | Mapping[str, Any],
        *,
        dtype: torch.dtype | str = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise EngineInputError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if isinstance(model_config, Mapping):  # a family's fields carry its "family" name
            model_config = (FamilyConfig(**model_config) if "family" in model_config
                            else ModelConfig(**model_config))
        config = model_config
        self.config = config
        self.dtype = dtype
        self.device = (process_device(device) if isinstance(device, str) and device in DEVICES
                       else torch.device(device))
        self._adapters = AdapterMerge()  # LoRA pushes: the base weights they merge into
        if isinstance(config, FamilyConfig):
            # a family (rollout/model/families/): transformers' model, its DynamicCache
            self.model = FamilyModel.from_config(config, dtype, self.device).eval()
            return
        # Built on the meta device and allocated once in the engine dtype: no random init of
        # weights the first push replaces (seconds for a real checkpoint), no fp32 copy.
        self.model = Qwen3MoeForCausalLM.empty(config, dtype, self.device).eval()
        # the decode loop runs the MoE blocks once per token: their stacked expert weights are
        # rebuilt only when a push changed them (checked by tensor and version counter)
        self.model.reuse_expert_stacks()

    def _load_weights(self, arrays: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Replace every model weight by a weight push, cast to the engine dtype; or, for a
        LoRA push (:mod:`replayrl.rollout.model.adapters`), merge its adapters into the base
        weights of the last full set (loaded first when the push holds one).

        Args:
            arrays: HF Qwen3-MoE parameter name -> float32 / float16 / float64 numpy array or a
                floating torch tensor (e.g. ``replayrl.rollout.model.checkpoint.state_dict_arrays``
                output); exactly the model's keys and shapes.

        Raises:
            EngineInputError: a value is neither a numpy array nor a floating tensor.
            replayrl.rollout.model.errors.CheckpointError: a missing / unexpected key, a wrong shape or
                dtype (raised by ``replayrl.rollout.model.checkpoint.load_state_arrays``, which checks
                everything before copying, so a bad push leaves the previous weights intact);
                for DeepSeek-V4, a hash-routing table the engine would not hold exactly as
                pushed (its ``check_pushed``, also before copying).
        """
        arrays, factors = split_adapter_push(arrays)
        if arrays:
            self._load_full(arrays)
        if factors:
            self._adapters.apply(self.model, factors)

    def _load_full(self, arrays: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """A full weight set (see :meth:`_load_weights`): the new base of later adapter pushes."""
        pushed: dict[str, np.ndarray] = {}
        for name, value in arrays.items():
            if isinstance(value, torch.Tensor):
                if not value.is_floating_point():
                    raise EngineInputError(f"load_weights: {name!r} must be floating, got {value.dtype}")
                # numpy has no bfloat16; widening to float32 is exact for bf16 / fp16 / fp32.
                pushed[name] = value.detach().to(device="cpu", dtype=torch.float32).numpy()
            elif isinstance(value, np.ndarray):
                pushed[name] = value
            else:
                raise EngineInputError(
                    f"load_weights: {name!r} must be a numpy array or torch tensor, got "
                    f"{type(value).__name__}"
                )
        check = getattr(self.model, "check_pushed", None)  # a family's own check (DeepSeek-V4's
        if check is not None:                              # hash tables), before anything is copied
            check(pushed)
        load_state_arrays(self.model, pushed)  # copies in place, cast to the model dtype
        self._adapters.reset()

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        vocab = self.config.vocab_size
        if len(prompts) == 0:
            raise EngineInputError("prompts must hold at least one prompt")
        checked = []
        for i, prompt in enumerate(prompts):
            ids = list(prompt)
            not_int = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
            if not_int:
                raise EngineInputError(f"prompts[{i}] holds non-integer token ids: {not_int[:8]!r}")
            ids = [int(t) for t in ids]
            if not ids:
                raise EngineInputError(f"prompts[{i}] is empty")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise EngineInputError(
                    f"prompts[{i}] holds token ids outside [0, {vocab}): {bad[:8]}"
                )
            checked.append(ids)
        return checked

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_new_tokens: int,
        eos_token_id: int,
        seed: int,
        traces: frozenset[str],
    ) -> list[Generation]:
        """Generate one turn per prompt (called by :meth:`Engine.generate` once weights are loaded).

        Args:
            prompts: ``B >= 1`` non-empty token-id sequences (ids in ``[0, vocab_size)``).
            params: sampling parameters (see :mod:`replayrl.rollout.sampling.sampler`).
            max_new_tokens: response length cap, ``>= 1``.
            eos_token_id: id whose sampling finishes a row (``finish_reason == "stop"``).
            seed: seeds the call's single ``torch.Generator``; same seed, prompts, params and
                weights give the same generations (the traces requested do not change them).
            traces: the trace fields to return; the others are ``None``.

        Returns:
            ``B`` :class:`Generation` objects in prompt order.

        Raises:
            EngineInputError: empty / out-of-vocabulary prompt, ``max_new_tokens < 1``,
                ``eos_token_id`` outside the vocabulary, or a trajectory longer than
                ``config.max_position_embeddings``.
            replayrl.rollout.errors.SamplingParamsError: ``top_k > vocab_size``.
            replayrl.rollout.sampling.sampler.NonFiniteLogitsError: the model produced NaN / inf logits.
            EngineError: the model's indexer picked a padding key (a model bug; never hidden).
        """
        cfg = self.config
        rows = self._check_prompts(prompts)
        for name, value in (("max_new_tokens", max_new_tokens), ("eos_token_id", eos_token_id), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise EngineInputError(f"{name} must be an int, got {value!r}")
        if max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
        if not 0 <= int(eos_token_id) < cfg.vocab_size:
            raise EngineInputError(
                f"eos_token_id {eos_token_id!r} outside the vocabulary [0, {cfg.vocab_size})"
            )
        width = params.support_width(cfg.vocab_size)
        lengths = [len(r) for r in rows]
        p_max = max(lengths)
        longest = p_max + int(max_new_tokens) - 1  # tokens forwarded for the longest row
        if longest > cfg.max_position_embeddings:
            raise EngineInputError(
                f"prompt length {p_max} + max_new_tokens {max_new_tokens} - 1 = {longest} exceeds "
                f"max_position_embeddings {cfg.max_position_embeddings}"
            )
        with torch.inference_mode():
            if getattr(self.model, "aligned_rows", False) and len(set(lengths)) > 1:
                return self._decode_by_length(rows, params, width, int(max_new_tokens),
                                              int(eos_token_id), seed, traces)
            return self._decode(rows, params, width, int(max_new_tokens), int(eos_token_id), seed,
                                traces)

    def _decode_by_length(self, rows: list[list[int]], params: SamplingParams, width: int,
                          max_new_tokens: int, eos_token_id: int, seed: int,
                          traces: frozenset[str]) -> list[Generation]:
        """:meth:`_decode` of each group of equal-length prompts on its own (same ``seed``),
        generations back in prompt order. For a model whose rows must start at slot 0
        (``aligned_rows``: DeepSeek-V4's compression windows), left padding would change its
        math: a prompt then gets exactly what it gets in a call of its own length group."""
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(len(r), []).append(i)
        out: list[Generation | None] = [None] * len(rows)
        for members in groups.values():
            gens = self._decode([rows[i] for i in members], params, width, max_new_tokens,
                                eos_token_id, seed, traces)
            for i, g in zip(members, gens):
                out[i] = g
        return out

    def _decode(
        self,
        rows: list[list[int]],
        params: SamplingParams,
        width: int,
        max_new_tokens: int,
        eos_token_id: int,
        seed: int,
        traces: frozenset[str],
    ) -> list[Generation]:
        """Prefill, then one decode step per new token until every row stopped or
        ``max_new_tokens``; ``rows`` are checked and fit the context (see :meth:`_generate`)."""
        dev = self.device
        batch = _PaddedBatch(rows, dev)
        want_routing = "routed_experts" in traces and len(self.config.moe_layers) > 0
        want_indexer = "indexer_topk" in traces and len(self.config.indexed_layers) > 0
        forward = _Forward(self.model, want_routing, want_indexer)
        generator = torch.Generator(device=dev)
        generator.manual_seed(int(seed))
        state = _DecodeState(len(rows), max_new_tokens, width, dev)

        logits = _prefill(forward, batch)
        key_mask = batch.key_mask
        for step in range(max_new_tokens):
            if step > 0:
                active = ~state.finished
                if not bool(active.any()):  # every row sampled EOS
                    break
                # one decode step: each row's last token through the KV cache (finished rows
                # are fed a pad token, masked out as a key; their outputs are discarded)
                feed = torch.where(active, state.tokens[:, step - 1], _PAD_FEED_ID).unsqueeze(1)
                pos = (batch.lengths + step - 1).unsqueeze(1)
                key_mask = torch.cat([key_mask, active.unsqueeze(1)], dim=1)
                logits = forward(feed, pos, key_mask)
            state.sample(step, logits, params, generator, eos_token_id)
        return self._generations(batch, state, forward, want_support="sample_support" in traces)

    def _generations(self, batch: "_PaddedBatch", state: "_DecodeState", forward: "_Forward", *,
                     want_support: bool) -> list[Generation]:
        """One :class:`Generation` per row from the call's device buffers.

        Whole-batch conversions, then per-row slices: one host copy per output instead of one
        per row and output. Every slice is of a fresh array (never an engine buffer) and
        read-only. Trace rows cover the key slots of the ``P + R - 1`` forwarded tokens.
        """
        routed = (_read_only(torch.cat(forward.routed_steps, dim=1), np.int32)
                  if forward.want_routing else None)
        indexer = None
        if forward.want_indexer:
            slots = torch.cat(forward.indexer_steps, dim=1)
            first_slot = batch.pads.view(-1, *[1] * (slots.dim() - 1))
            indexer = _read_only(self._slots_to_positions(slots, first_slot), np.int32)
        tokens_np = _read_only(state.tokens, np.int32)
        logprobs_np = _read_only(state.logprobs, np.float32)
        support_np = _read_only(state.support, np.int32) if want_support else None
        lens, firsts, stops = state.resp_len.tolist(), batch.pads.tolist(), state.stopped.tolist()
        p_max = batch.p_max

        generations = []
        for i in range(len(lens)):
            r = lens[i]
            first, end = firsts[i], p_max + r - 1  # key slots of the P + R - 1 forwarded tokens
            generations.append(
                Generation(
                    response_ids=tokens_np[i, :r],
                    rollout_logprobs=logprobs_np[i, :r],
                    sample_support=support_np[i, :r] if want_support else None,
                    routed_experts=routed[i, first:end] if routed is not None else None,
                    indexer_topk=indexer[i, first:end] if indexer is not None else None,
                    finish_reason="stop" if stops[i] else "length",
                )
            )
        return generations

    @staticmethod
    def _slots_to_positions(slots: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Map indexer key slots ``[B, S, L, K]`` (into the left-padded cache) to trajectory
        positions; ``pad`` holds each row's left-padding count, broadcastable to ``slots``.

        Only the key slots of each row's forwarded tokens reach a trajectory; rows of padding
        queries hold -1 (the model gives padding queries no indexer keys).
        """
        picked = slots >= 0
        bad = picked & (slots < pad)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise EngineError(
                f"prompt {row}: field indexer_topk: the model's indexer selected a padding key "
                f"slot (< {int(pad.reshape(-1)[row])}); refusing to emit a trace that points "
                f"outside the trajectory"
            )
        return torch.where(picked, slots - pad, slots)


class _PaddedBatch:
    """The prompts of one call left-padded to the longest, as the model's prefill inputs.

    Attributes (all on ``device``): ``input_ids`` int64 ``[B, P_max]`` (padding slots hold
    ``_PAD_FEED_ID``); ``key_mask`` bool ``[B, P_max]``, True = real token; ``position_ids``
    int64 ``[B, P_max]`` counting ``0..`` over each row's real tokens (0 in padding slots,
    which are masked out, so any in-range position works); ``lengths`` int64 ``[B]`` prompt
    lengths; ``pads`` int64 ``[B]`` left-pad counts (= key slot of each row's first token);
    ``p_max`` the longest prompt length (int).
    """

    __slots__ = ("input_ids", "key_mask", "position_ids", "lengths", "pads", "p_max")

    def __init__(self, rows: list[list[int]], device: torch.device) -> None:
        batch = len(rows)
        self.lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=device)
        self.p_max = p_max = int(self.lengths.max())
        self.pads = pads = p_max - self.lengths
        self.input_ids = torch.full((batch, p_max), _PAD_FEED_ID, dtype=torch.int64, device=device)
        for i, r in enumerate(rows):
            self.input_ids[i, p_max - len(r):] = torch.tensor(r, dtype=torch.int64, device=device)
        slots = torch.arange(p_max, device=device).unsqueeze(0)
        self.key_mask = slots >= pads.unsqueeze(1)
        self.position_ids = (slots - pads.unsqueeze(1)).clamp_min(0)


class _Forward:
    """The model forward of one generate call: owns its KV cache and collects the traces.

    Calling it runs one forward over ``ids`` / ``pos`` / ``mask`` (int64 ``[B, S]`` / int64
    ``[B, S]`` / bool ``[B, keys]``) through the cache and returns the last position's logits
    ``[B, V]`` (engine dtype); each call appends its routing ``[B, S, L_moe, K]`` and indexer
    key slots ``[B, S, L_idx, K_idx]`` to :attr:`routed_steps` / :attr:`indexer_steps` when
    wanted (they stay on the device and are gathered once at the end).
    """

    __slots__ = ("model", "cache", "want_routing", "want_indexer", "capture", "routed_steps",
                 "indexer_steps")

    def __init__(self, model: Qwen3MoeForCausalLM, want_routing: bool, want_indexer: bool) -> None:
        self.model = model
        self.cache = model.new_kv_cache()
        self.want_routing = want_routing
        self.want_indexer = want_indexer
        self.capture = want_routing or want_indexer
        self.routed_steps: list[torch.Tensor] = []
        self.indexer_steps: list[torch.Tensor] = []

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(ids, pos, key_padding_mask=mask, kv_cache=self.cache, capture=self.capture)
        if self.want_routing:
            self.routed_steps.append(out.routed_experts)
        if self.want_indexer:
            self.indexer_steps.append(out.indexer_topk)
        return out.logits[:, -1, :]

    def select_rows(self, index: torch.Tensor) -> None:
        """Replace the cache rows and the last captured step by their rows ``index`` (int64
        ``[B]``): a forward over distinct rows, expanded back to one row per prompt. The embedded
        model's cache keeps a prompt group's prompt once in its dense layers
        (:meth:`replayrl.rollout.model.kv_cache.KVCache.share_rows`)."""
        share = getattr(self.cache, "share_rows", None)
        self.cache = share(index) if share is not None else self.cache.select_rows(index)
        for steps in (self.routed_steps, self.indexer_steps):
            if steps:
                steps[-1] = steps[-1][index]


def _prefill(forward: _Forward, batch: _PaddedBatch) -> torch.Tensor:
    """Prefill the call's prompts; returns the last logits ``[B, V]``.

    Each distinct (left-padded) prompt is forwarded once: the samples of a prompt group share
    it, so their prefill rows would be identical computations. The rows of the cache, the
    captured choices and the last logits are then indexed back to one per row.
    """
    input_ids, key_mask, position_ids = batch.input_ids, batch.key_mask, batch.position_ids
    size = input_ids.shape[0]
    rows_key = torch.cat([input_ids, key_mask.long()], dim=1)
    _, inverse = torch.unique(rows_key, dim=0, return_inverse=True)
    distinct = int(inverse.max()) + 1
    if distinct == size:
        return forward(input_ids, position_ids, key_mask)
    dev = input_ids.device
    first = torch.full((distinct,), size, dtype=torch.int64, device=dev).scatter_reduce(
        0, inverse, torch.arange(size, device=dev), "amin")
    logits = forward(input_ids[first], position_ids[first], key_mask[first])[inverse]
    forward.select_rows(inverse)
    return logits


class _DecodeState:
    """What one generate call has sampled so far, in device buffers filled one step at a time.

    Attributes (``B`` rows, ``T = max_new_tokens``, ``W`` support width): ``tokens`` int64
    ``[B, T]``, ``logprobs`` float32 ``[B, T]`` (behaviour logprobs, nats), ``support`` int32
    ``[B, T, 1 + W]`` (-1 padded), ``resp_len`` int64 ``[B]``, ``finished`` / ``stopped`` bool
    ``[B]`` (a row that sampled EOS is both; nothing else finishes a row early).
    """

    __slots__ = ("tokens", "logprobs", "support", "resp_len", "finished", "stopped")

    def __init__(self, batch: int, max_new_tokens: int, width: int, device: torch.device) -> None:
        self.tokens = torch.full((batch, max_new_tokens), _PAD_FEED_ID, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
        self.support = torch.full((batch, max_new_tokens, 1 + width), -1, dtype=torch.int32,
                                  device=device)
        self.resp_len = torch.zeros(batch, dtype=torch.int64, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)

    def sample(self, step: int, logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator, eos_token_id: int) -> None:
        """Sample token ``step`` of every unfinished row from ``logits`` ``[B, V]`` and record
        it with its logprob and support; a row that sampled ``eos_token_id`` stops.

        Raises:
            replayrl.rollout.sampling.sampler.NonFiniteLogitsError: NaN / inf logits in an active row.
        """
        active_rows = (~self.finished).nonzero().flatten()
        out = sample(logits.index_select(0, active_rows), params, generator)
        self.tokens[active_rows, step] = out.ids
        self.logprobs[active_rows, step] = out.logprobs
        self.support[active_rows, step] = out.support
        self.resp_len[active_rows] += 1
        hit_eos = out.ids == eos_token_id
        self.stopped[active_rows[hit_eos]] = True
        self.finished[active_rows[hit_eos]] = True
