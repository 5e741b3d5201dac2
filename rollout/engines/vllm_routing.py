"""Routed-expert capture inside an in-process vLLM: forward hooks on each MoE layer's gate.

vLLM's own capture (``enable_return_routed_experts``) needs its model runner V2, which needs a
Triton CPU backend that is not published, so on CPU the router's choice is read where it is
made: a forward hook on every MoE layer's ``mlp.gate`` sees the router logits ``[N, E]`` of the
``N`` tokens of one engine step, and a pre-hook on the model sees their ``positions``. Which
request each token belongs to comes from the model runner's batch (``input_batch.req_ids`` in
batch order, ``query_start_loc`` the token ranges), as vLLM lays the step out. The expert ids
are ``topk(router logits, K)``: vLLM's softmax top-k routing picks the same experts since
softmax is monotone (docs/design/engines.md#engines).

Nothing here imports vllm; the hooks are installed through ``LLM.collective_rpc``, which hands
the in-process worker to a function.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

__all__ = ["RoutingRecorder", "external_request_id"]


def external_request_id(internal: str) -> str:
    """The id a request was added with, from vLLM's internal ``"{id}-{8 random chars}"``."""
    return internal.rsplit("-", 1)[0]


class RoutingRecorder:
    """Collects, per request and trajectory position, the experts every MoE layer chose.

    Args:
        moe_layers: global ids of the MoE layers (``ModelConfig.moe_layers``; ``L_moe`` order).
        top_k: experts per token ``K``.

    Rows are kept only while :attr:`active` (set by the engine around its own requests) and for
    request ids in :attr:`wanted`; a position computed twice (a preempted request recomputed)
    keeps the later row, the one the rest of the generation attended through.
    """

    def __init__(self, moe_layers: tuple[int, ...], top_k: int) -> None:
        self.moe_layers = tuple(moe_layers)
        self.top_k = int(top_k)
        self.wanted: set[str] = set()
        self.rows: dict[str, dict[int, np.ndarray]] = {}
        self.active = False
        self._lock = threading.Lock()
        self._step: dict[str, Any] | None = None
        self._runner: Any = None

    def install(self, worker: Any) -> int:
        """Hook the worker's model (called through ``LLM.collective_rpc``); returns the number
        of hooked gates.

        Raises:
            RuntimeError: a layer listed as MoE has no ``mlp.gate`` (another architecture than
                the checkpoint's config says).
        """
        runner = worker.model_runner
        model = runner.get_model()
        self._runner = runner
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        layers = model.model.layers
        for slot, layer_id in enumerate(self.moe_layers):
            gate = getattr(getattr(layers[layer_id], "mlp", None), "gate", None)
            if gate is None:
                raise RuntimeError(f"vLLM layer {layer_id} has no mlp.gate; the model is not "
                                   f"the Qwen3-MoE the config describes")
            gate.register_forward_hook(self._gate_hook(slot))
        model.register_forward_hook(self._after_forward)
        return len(self.moe_layers)

    def start(self, request_ids: list[str]) -> None:
        """Record rows for these (external) request ids from now on."""
        with self._lock:
            self.wanted = set(request_ids)
            self.rows = {rid: {} for rid in request_ids}
            self.active = True

    def stop(self) -> dict[str, dict[int, np.ndarray]]:
        """Stop recording; returns request id -> position -> int32 ``[L_moe, K]``."""
        with self._lock:
            self.active = False
            rows, self.rows, self.wanted = self.rows, {}, set()
            return rows

    def _before_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        if not self.active:
            self._step = None
            return
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        batch = self._runner.input_batch
        n = batch.num_reqs
        bounds = self._runner.query_start_loc.np[:n + 1].tolist()
        owners = [(external_request_id(rid), bounds[i], bounds[i + 1])
                  for i, rid in enumerate(batch.req_ids[:n])]
        self._step = {"positions": positions.detach().to("cpu", torch.int64).numpy(),
                      "owners": owners, "experts": [None] * len(self.moe_layers)}

    def _gate_hook(self, slot: int):
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if self._step is None:
                return
            logits = output[0] if isinstance(output, tuple) else output
            ids = torch.topk(logits.detach().float(), self.top_k, dim=-1).indices
            self._step["experts"][slot] = ids.to("cpu", torch.int32).numpy()
        return hook

    def _after_forward(self, module: Any, inputs: Any, output: Any) -> None:
        step, self._step = self._step, None
        if step is None or any(e is None for e in step["experts"]):
            return
        stacked = np.stack(step["experts"], axis=1)  # [N, L_moe, K]
        with self._lock:
            for rid, lo, hi in step["owners"]:
                if rid not in self.wanted:
                    continue
                mine = self.rows[rid]
                for pos, row in zip(step["positions"][lo:hi].tolist(), stacked[lo:hi]):
                    mine[pos] = row
