"""R3 through megatron-core's own ``RouterReplay``: our traces in, the routing used / own out.

megatron-core 0.16.1 has routing replay built in (``moe_enable_routing_replay=True``): every
``TopKRouter`` owns a ``RouterReplay`` whose ``get_replay_topk`` either records the router's
top-k (``RECORD``) or returns the target indices it was given (``REPLAY_FORWARD``; the routing
probabilities are the router's scores gathered at those indices, so the router keeps its
gradients). Its layout is one int64 tensor ``[tokens, K]`` per MoE layer, tokens sequence-major
(the router sees ``[S, B, H]`` flattened), each sequence-parallel rank holding its
``torch.chunk`` slice of the sequence.

:class:`RoutingReplay` converts our padded batch trace ``routed_experts`` (int32
``[B, S, L_moe, K]``, ``-1`` rows = nothing captured) into that layout for the MoE layers of the
local pipeline stage only (:class:`replayrl.trainer.parallel.replay_registry.ReplayRegistry` over the
stage's global layer ids, :func:`replayrl.trainer.parallel.replay_registry.sp_slice` for the SP rank),
and back: the experts used and the router's own top-k, all-gathered over the SP ranks, as
``[B, S, L_local, K]``. Each layer's replay instance (:class:`_TraceRouterReplay`) also computes
the router's own top-k under replay, fills ``-1`` rows with it
(:func:`replayrl.trainer.parallel.replay_registry.fill_own_choice`, as the embedded model does) and keeps
it for the flip / drift metrics (docs/design/megatron.md#megatron-backend).

megatron drives replay through a process-wide list, ``RouterReplay.global_router_replay_instances``,
that every router ever built appends to: with two models built in one process (a rebuild, a second
backend, a test), arming "all routers" there arms whichever model's instances the list holds, and
the other model silently routes by its own choice (verl#7340). :class:`RoutingReplay` therefore
never uses that list: it arms, reads and clears the instances it installed on its own model's
routers, keeps them (and the replaced defaults) out of the list, and before each forward checks
that every MoE router of its model still holds its instance, else
:class:`replayrl.trainer.errors.ReplayTargetError` naming the layer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from replayrl.trainer.errors import ReplayTargetError
from replayrl.trainer.parallel.replay_registry import ReplayRegistry, fill_own_choice, sp_slice

__all__ = ["RoutingReplay"]


def _unlist(instance) -> None:
    """Take ``instance`` out of megatron's process-wide ``RouterReplay`` list (if it is there)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    listed = RouterReplay.global_router_replay_instances
    listed[:] = [r for r in listed if r is not instance]


def _routers(model) -> dict:
    """Global layer id (0-based) -> ``TopKRouter`` of every MoE layer of ``model``'s decoder."""
    out = {}
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            out[layer.layer_number - 1] = router
    return out


def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class _TraceRouterReplay(RouterReplay):
        """megatron's ``RouterReplay`` that also keeps the router's own top-k under replay and
        keeps the router's choice on rows whose replayed indices are all ``-1``."""

        own_topk_idx = None

        def __init__(self) -> None:
            super().__init__()
            _unlist(self)  # driven by its RoutingReplay only, never through the global list

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk=None):
            probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.own_topk_idx = own
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                target = fill_own_choice(self.target_topk_idx.to(scores.device), own)
                self.record_indices(target)
                return scores.gather(1, target), target
            self.record_indices(own)
            return probs, own

    return _TraceRouterReplay


class RoutingReplay:
    """Feeds routing traces to a GPTModel's routers and reads back the routing they used.

    Args:
        model: this rank's ``GPTModel`` (its decoder layers carry global ``layer_number``).
        config: the :class:`replayrl.rollout.model.config.ModelConfig` it was built from.

    Replaces every router's ``RouterReplay`` with the trace-aware one, which only this object
    arms, reads and clears (megatron's process-wide instance list is left out: any number of
    models may live in one process).

    Raises:
        ValueError: the model's MoE layers are not the config's for this stage.
    """

    def __init__(self, model, config) -> None:
        from megatron.core import parallel_state as ps

        cls = _replay_class()
        self.registry = ReplayRegistry.for_routing(config)
        self.topk = config.num_experts_per_tok
        self.model = model
        routers = _routers(model)
        self.registry.register(layer.layer_number - 1 for layer in model.decoder.layers)
        if tuple(routers) != self.registry.layers:
            raise ValueError(f"MoE routers on layers {tuple(routers)} but the model config "
                             f"has MoE layers {self.registry.layers} here")
        for router in routers.values():
            _unlist(router.router_replay)  # megatron's default instance, replaced here
            router.router_replay = cls()
        self.routers = routers
        self.instances = [routers[i].router_replay for i in self.registry.layers]
        self.sp_rank = ps.get_tensor_model_parallel_rank()
        self.sp_size = ps.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1
        self.sp_group = ps.get_tensor_model_parallel_group()

    @property
    def layers(self) -> tuple[int, ...]:
        """Global ids of the local stage's MoE layers (the ``L_local`` axis, increasing)."""
        return self.registry.layers

    def router_targets(self, trace: torch.Tensor) -> list[torch.Tensor]:
        """megatron's per-layer replay targets from a batch trace.

        Args:
            trace: int ``[B, S, L_moe, K]`` (all MoE layers of the model), ``-1`` = none.

        Returns:
            one int64 ``[S_local * B, K]`` per local MoE layer: sequence-major, this SP rank's
            ``torch.chunk`` slice of the sequence.

        Raises:
            replayrl.trainer.parallel.replay_registry.ReplayError: a trace of the wrong shape.
        """
        out = []
        for layer in self.layers:
            stream = self.registry.stream(trace, layer)  # [B, S, K]
            b, s, k = stream.shape
            flat = stream.transpose(0, 1).reshape(s * b, k)
            out.append(sp_slice(flat, self.sp_rank, self.sp_size).long().contiguous())
        return out

    def check_live(self) -> None:
        """Check that every MoE router of the model holds this object's replay instance.

        Raises:
            replayrl.trainer.errors.ReplayTargetError: naming the first layer whose router is
                not the one armed here, or holds another replay instance (another
                :class:`RoutingReplay` took it), or is a MoE layer this object does not know.
        """
        live = _routers(self.model)
        for layer in sorted(set(live) | set(self.routers)):
            router, mine = live.get(layer), self.routers.get(layer)
            if mine is None:
                raise ReplayTargetError(layer, "a MoE router of the model that this replay did not arm")
            if router is not mine:
                raise ReplayTargetError(layer, "the model's router is not the one this replay armed "
                                               "(its layers were rebuilt)")
            if router.router_replay is not self.instances[self.layers.index(layer)]:
                raise ReplayTargetError(layer, "the router holds another replay instance "
                                               f"({type(router.router_replay).__name__} "
                                               f"{id(router.router_replay):#x}): another routing replay "
                                               "took it; build a new one for this model")

    def begin(self, trace: torch.Tensor | None) -> None:
        """Arm this model's routers for one forward: replay ``trace`` (see
        :meth:`router_targets`), or record the routers' own choice when ``trace`` is None.

        Raises:
            replayrl.trainer.errors.ReplayTargetError: as :meth:`check_live`.
            replayrl.trainer.parallel.replay_registry.ReplayError: as :meth:`router_targets`.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.check_live()
        targets = self.router_targets(trace) if trace is not None else None
        for i, instance in enumerate(self.instances):
            instance.clear_indices()
            if targets is None:
                instance.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                instance.set_target_indices(targets[i])
                instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def collect(self, batch_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts used and the routers' own top-k of the last forward.

        A collective over the SP group when sequence parallelism is on.

        Returns:
            ``(used, own)``, int32 ``[B, S, L_local, K]`` each (``S`` the forwarded width), or
            None when this stage has no MoE layer.
        """
        if not self.instances:
            return None
        used = [self._gather(r.recorded_topk_idx) for r in self.instances]
        own = [self._gather(r.own_topk_idx) for r in self.instances]
        shape = lambda t: t.reshape(-1, batch_rows, self.topk).transpose(0, 1)
        return (torch.stack([shape(t) for t in used], dim=2).to(torch.int32),
                torch.stack([shape(t) for t in own], dim=2).to(torch.int32))

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.sp_size == 1:
            return local.detach()
        parts = [torch.empty_like(local) for _ in range(self.sp_size)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.sp_group)
        return torch.cat(parts)

    def end(self) -> None:
        """Drop the targets and recorded indices and leave the routers in their own mode."""
        for instance in self.instances:
            instance.clear_indices()
            instance.clear_router_replay_action()
