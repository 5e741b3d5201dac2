"""Trainer backends: the model-owning part of the trainer, chosen by ``--train-backend``.

A backend owns the policy weights and the optimizer and does everything that touches them:
the replayed forwards (preflight / proximal logprobs with the captured traces, and the
training forward), backward per microbatch, gradient clip + optimizer step, the weight arrays
pushed to the engines, checkpoint save / load and the weight digest. The interface is
:class:`replayrl.trainer.backends.base.TrainerBackend`; :class:`replayrl.trainer.ranks.trainer_actor.TrainerActor` keeps
the orchestration (batches, version clock, proximal cache, RS gate / refill, advantages,
losses, metrics, weight push) and talks to the backend only through that interface.

:data:`BACKENDS` is the one registry: name -> ``"module:Class"``. The values are strings so
that a backend's dependencies (megatron-core for a megatron backend) are imported only when
that backend is chosen. A new backend is one sibling file in this package plus one line here.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from replayrl.actors.registry import LazyRegistry
from replayrl.trainer.errors import TrainerConfigError, UnknownBackendError

if TYPE_CHECKING:
    from replayrl.trainer.backends.base import TrainerBackend

__all__ = ["BACKENDS", "UnknownBackendError", "resolve_backend"]

BACKENDS = LazyRegistry(
    MappingProxyType({  # read-only: a backend is added here, not at run time
        "torch": "replayrl.trainer.backends.torch_backend:TorchBackend",
        "megatron": "replayrl.trainer.backends.megatron_backend:MegatronBackend",
        "fsdp": "replayrl.trainer.backends.fsdp_backend:FSDPBackend",
    }),
    # a string, as the entries: the interface imports torch, and importing this registry
    # (the trainer's settings do) imports none
    base="replayrl.trainer.backends.base:TrainerBackend",
    unknown=lambda name, known: UnknownBackendError(f"unknown trainer backend {name!r}; "
                                                    f"known backends: {known}"),
    invalid=lambda name, why: TrainerConfigError(f"trainer backend {name!r}: {why}"))
"""Backend name (``--train-backend``) -> ``"module:Class"`` of a :class:`TrainerBackend`."""


def resolve_backend(name: str) -> "type[TrainerBackend]":
    """The backend class registered as ``name``, imported on this call.

    Raises:
        UnknownBackendError: ``name`` is not a key of :data:`BACKENDS` (names it and lists the
            known backends).
        TrainerConfigError: the registered module or class cannot be imported, or is not a
            :class:`TrainerBackend` subclass (names the backend and the path).
    """
    return BACKENDS.resolve(name)
