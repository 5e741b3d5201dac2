"""The weight-sync room: how a push of the trainer's weights reaches the engines, one interface and its implementations.

A weight sync (:class:`replayrl.rollout.weight_sync.base.WeightSync`) has two halves in one
class: the trainer side *packs* the tensors of a push and delivers it (trainer rank 0, the
``TrainerActor``), the engine side *loads* it into an engine (the ``EngineActor``). Both halves
live here so a way of moving weights is one file: the trainer layer reaches this room (and
nothing else of the engines); the trainer backends only hand over their tensors
(``TrainerBackend.push_tensors``) and never see a transport (tests/unit/test_layering.py).

:data:`WEIGHT_SYNCS` is the registry, ``--weight-sync NAME`` picks one (``auto``: today's
choice, :func:`replayrl.rollout.weight_sync.run_check.resolve`):

* ``zmq`` -- an array bundle in ordinary memory, sent to each engine as ZeroMQ frames;
* ``shm`` -- the bundle in this process's shared-memory pool (the torch backend's weights live
  there: a push copies nothing), carried to ipc engines by handle;
* ``disk`` -- a safetensors file in a directory every engine reads (an SGLang server reads it
  itself through ``/update_weights_from_disk``);
* ``dist`` -- bucketed broadcasts from trainer rank 0 over a torch.distributed group made for the
  purpose (gloo on CPU, NCCL on CUDA; SGLang's ``/init_weights_update_group`` +
  ``/update_weights_from_distributed``);
* ``ipc`` -- CUDA IPC handles of the weights on one node (CUDA only).

Adding one = one module here with a :class:`WeightSync` subclass, one line in
:data:`WEIGHT_SYNCS`, and its refusals in :mod:`replayrl.rollout.weight_sync.run_check`. The
registry holds ``"module:Class"`` strings: importing this package imports no torch.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from replayrl.actors.registry import LazyRegistry
from replayrl.rollout.errors import RolloutConfigError, WeightSyncError

if TYPE_CHECKING:
    from replayrl.rollout.weight_sync.base import WeightSync

__all__ = ["WEIGHT_SYNCS", "WEIGHT_SYNC_CHOICES", "WeightSyncError", "resolve_weight_sync"]

WEIGHT_SYNCS = LazyRegistry(
    MappingProxyType({  # read-only: a weight sync is added here, not at run time
        "zmq": "replayrl.rollout.weight_sync.zmq:ZmqSync",
        "shm": "replayrl.rollout.weight_sync.shm:ShmSync",
        "disk": "replayrl.rollout.weight_sync.disk:DiskSync",
        "dist": "replayrl.rollout.weight_sync.dist:DistSync",
        "ipc": "replayrl.rollout.weight_sync.ipc:IpcSync",
    }),
    # a string, as the entries: the interface imports torch, this registry does not
    base="replayrl.rollout.weight_sync.base:WeightSync",
    unknown=lambda name, known: RolloutConfigError(f"unknown weight sync {name!r}; known: {known}"),
    invalid=lambda name, why: WeightSyncError(f"weight sync {name!r}: {why}"))
"""Weight-sync name (``--weight-sync``) -> ``"module:Class"`` of a :class:`WeightSync`."""

WEIGHT_SYNC_CHOICES = ("auto", *WEIGHT_SYNCS)
"""What ``--weight-sync`` accepts: ``auto`` (resolved per run) or a registered name."""


def resolve_weight_sync(name: str) -> "type[WeightSync]":
    """The weight-sync class registered as ``name``, imported on this call.

    Raises:
        RolloutConfigError: ``name`` is not registered (names it and lists the known ones).
        WeightSyncError: the registered class cannot be imported or is not a ``WeightSync``.
    """
    return WEIGHT_SYNCS.resolve(name)
