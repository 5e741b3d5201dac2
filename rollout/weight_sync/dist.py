"""The dist weight sync: bucketed broadcasts from trainer rank 0 to every engine over a group made for them.

The group (:mod:`replayrl.rollout.weight_sync.dist_group`): trainer rank 0 is rank 0 and hosts
the store on a free port; the engines are ranks ``1 .. N`` in the order the trainer lists them.
It is formed at the first push and again whenever the engines that take part change (one lost
under ``--engine-failure regenerate``, a restarted one back): the trainer calls every engine
actor's ``join_weight_group`` while it joins itself, and an engine leaves its previous group
first. Backend: ``gloo`` when the pushed tensors are on the CPU, ``nccl`` when on CUDA.

A push: the trainer copies the tensors into buckets (:func:`dist_group.flatten`, at most
``bucket_bytes`` each), sends each engine a manifest naming the group and the buckets
(``load_weights``), and broadcasts the buckets from a thread of its own while it goes on
training (the push overlaps the next generation as every push does); each engine receives them
in a thread (its generations go on meanwhile), then loads the tensors between generations, at
the push's version, as any push. An engine that is an SGLang client (``Engine`` with
``init_weights_update_group`` / ``load_weights_from_distributed``) has its server join the group
and receive instead (``/init_weights_update_group``, ``/update_weights_from_distributed``).

A member lost during a push fails the broadcast for all; the trainer then forms the group anew
without it and pushes again (``replayrl.trainer.ranks.trainer_actor``), as ``--engine-failure``
allows. The group's collectives run in daemon threads, so a process is never kept alive by one
waiting for a peer that is gone.
"""
from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable, Collection, Mapping, Sequence

import torch

from replayrl.rollout.errors import WeightSyncError
from replayrl.rollout.weight_sync import dist_group
from replayrl.rollout.weight_sync.base import (
    Delivery,
    EngineProxy,
    Packed,
    WeightHome,
    WeightSync,
    manifest,
)

__all__ = ["DistSync", "master_address", "in_daemon_thread"]

DEFAULT_TIMEOUT_S = 600.0
"""Seconds a rank waits for the others (forming the group, each broadcast) unless
``timeout_s`` is set (the launcher gives ``--rpc-timeout-seconds``)."""


def master_address(endpoint: str, peer_hosts: Sequence[str] = ()) -> str:
    """The address the engines reach trainer rank 0 at: its actor's own host for a ``tcp://``
    endpoint; else the address toward the first of ``peer_hosts`` (an SGLang server's host,
    :func:`dist_group.address_toward`); else ``127.0.0.1``."""
    if endpoint.startswith("tcp://"):
        return endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    for host in peer_hosts:
        return dist_group.address_toward(host)
    return "127.0.0.1"


def in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run the blocking ``fn()`` on a daemon thread of its own; a future of its result (its
    exception). Unlike the event loop's executor, a thread left waiting on a lost peer does not
    hold the process at exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001  (handed to the awaiting task)
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="replayrl-weight-group", daemon=True).start()
    return future


class DistSync(WeightSync):
    """Bucketed broadcasts over a torch.distributed group (``--weight-sync dist``).

    Settings (trainer side): ``endpoint`` (the trainer actor's, for :func:`master_address`),
    ``peer_hosts`` (SGLang servers' hosts), ``address`` (overrides both), ``bucket_bytes``
    (default :data:`dist_group.DEFAULT_BUCKET_BYTES`), ``timeout_s`` (default
    :data:`DEFAULT_TIMEOUT_S`).
    """

    name = "dist"
    collective = True

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.timeout_s = float(settings.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.bucket_bytes = int(settings.get("bucket_bytes", dist_group.DEFAULT_BUCKET_BYTES))
        self._group: Any = None  # this process's member of the current group
        self._group_name = ""
        self._members: list[str] = []  # trainer side: the engines of the group, rank order
        self._backend = ""
        self._store: Any = None  # trainer side: the group's store (rank 0 hosts it)
        self._formed = 0  # groups formed by this process (their names differ)
        self._device: torch.device = torch.device("cpu")  # engine side: where buckets land
        self._engine: Any = None  # engine side: an engine whose server is the member
        # the collective in flight on the current group (trainer: the broadcast; engine: the
        # receive); a group is not destroyed under it (its thread finishes or times out first)
        self._transfer: asyncio.Future | None = None

    # -- trainer side ------------------------------------------------------------------------

    def pack(self, tensors: Mapping[str, torch.Tensor], *, version: int,
             home: WeightHome | None = None) -> Packed:
        """See :meth:`WeightSync.pack`: the tensors copied into buckets on their device; the
        manifest describes them (:data:`dist_group.Bucket`). ``keep``: the bucket data.

        Raises:
            WeightSyncError: no tensors, or tensors on more than one device.
        """
        if not tensors:
            raise WeightSyncError("weight sync 'dist': a push without tensors")
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise WeightSyncError(f"weight sync 'dist': the pushed tensors lie on several "
                                  f"devices {sorted(map(str, devices))}")
        plan = dist_group.plan_buckets(tensors, self.bucket_bytes)
        specs = [dist_group.spec_of(names, tensors) for names in plan]
        with torch.no_grad():
            data = [dist_group.flatten([tensors[n] for n in names]) for names in plan]
        return Packed(manifest(self.name, buckets=specs,
                               backend=dist_group.group_backend(next(iter(devices)))),
                      int(sum(d.numel() for d in data)), keep=data)

    async def deliver(self, packed: Packed, version: int, engines: Sequence[str],
                      proxy: EngineProxy, lost: Collection[str] = ()) -> Delivery:
        """See :meth:`WeightSync.deliver`: the engines not in ``lost`` (the group is formed
        again when they changed), a ``load_weights`` call each naming the group, and the
        broadcast of every bucket in a thread (:attr:`Delivery.transfer`).

        Raises:
            WeightSyncError: the group did not form (names the engine that failed to join).
            replayrl.actors.ActorError: an engine's ``join_weight_group`` call failed.
        """
        if set(lost) & set(self._members):
            self.close()  # a member is gone: the group is broken for the others too
        members = [e for e in engines if e not in set(lost)]
        if not members:
            return Delivery({})
        backend = packed.payload["backend"]
        if self._group is None or self._members != members or self._backend != backend:
            await self._form(members, proxy, backend)
        payload = {**packed.payload, "group": self._group_name}
        loads = {e: asyncio.ensure_future(proxy(e).load_weights(version, payload)) for e in members}
        group, data = self._group, packed.keep

        def broadcast() -> None:
            try:
                for bucket in data:
                    dist_group.broadcast_bucket(bucket, group)
            except (RuntimeError, ValueError) as exc:
                raise WeightSyncError(f"weight sync 'dist': the broadcast of version {version} "
                                      f"to {members} failed: {type(exc).__name__}: {exc}") from None

        self._transfer = in_daemon_thread(broadcast)
        return Delivery(loads, self._transfer)

    async def _form(self, members: list[str], proxy: EngineProxy, backend: str) -> None:
        """Form a new group of this process (rank 0) and ``members`` (ranks 1..), leaving the
        previous one."""
        self.close()
        world = 1 + len(members)
        address = self.settings.get("address") or master_address(
            self.settings.get("endpoint", ""), self.settings.get("peer_hosts", ()))
        store = dist_group.make_store(world, self.timeout_s)
        self._formed += 1
        name = f"replayrl-weights-{os.getpid()}-{self._formed}"
        spec = {"master_address": address, "master_port": int(store.port), "world_size": world,
                "group_name": name, "backend": backend, "timeout_s": self.timeout_s}
        joins = [asyncio.ensure_future(proxy(e).join_weight_group({**spec, "rank_offset": 1 + i}))
                 for i, e in enumerate(members)]
        local = in_daemon_thread(lambda: dist_group.join_group(
            backend=backend, master_address=address, master_port=store.port, rank=0,
            world_size=world, group_name=name, timeout_s=self.timeout_s, store=store))
        done = await asyncio.gather(local, *joins, return_exceptions=True)
        failed = [(who, r) for who, r in zip(["trainer", *members], done) if isinstance(r, BaseException)]
        if failed:
            if not isinstance(done[0], BaseException):
                dist_group.destroy_group(done[0])
            who, error = failed[0]
            if who != "trainer" and not isinstance(error, WeightSyncError):
                raise error  # the engine's own failure (lost, timed out): the caller judges it
            raise WeightSyncError(f"weight group {name} at {address}:{store.port} of "
                                  f"{members}: {who} did not join: {error}") from None
        self._group, self._store, self._group_name = done[0], store, name
        self._members, self._backend = list(members), backend

    def _drop_group(self) -> None:
        """Destroy this process's member of the current group, unless a collective still runs
        on it (a member lost mid-push leaves it waiting until the group's timeout): then it is
        only dropped, and its daemon thread keeps it until then."""
        if self._group is not None and (self._transfer is None or self._transfer.done()):
            dist_group.destroy_group(self._group)
        self._group, self._transfer = None, None

    def close(self) -> None:
        """Leave the current group (trainer side); the next :meth:`deliver` forms a new one."""
        self._drop_group()
        self._store, self._members = None, []

    # -- engine side -------------------------------------------------------------------------

    async def join(self, engine: Any, spec: Mapping[str, Any]) -> None:
        """See :meth:`WeightSync.join`: leave the previous group, then join this one as rank
        ``rank_offset`` (in a thread; it returns once every rank joined). An engine whose
        server is the member (``init_weights_update_group(spec)``) has its server join instead.

        Raises:
            WeightSyncError: the group did not form, or ``nccl`` for an engine on the CPU.
        """
        self.leave()
        own = getattr(engine, "init_weights_update_group", None)
        if own is not None:
            await in_daemon_thread(lambda: own(dict(spec)))
            self._engine, self._group_name = engine, str(spec["group_name"])
            return
        device = torch.device(getattr(engine, "device", "cpu"))
        if dist_group.group_backend(device) != spec["backend"]:
            raise WeightSyncError(f"weight group {spec['group_name']}: the trainer's weights "
                                  f"broadcast over {spec['backend']}, this engine computes on "
                                  f"{device}; use --device alike for both")
        self._group = await in_daemon_thread(lambda: dist_group.join_group(
            backend=spec["backend"], master_address=spec["master_address"],
            master_port=int(spec["master_port"]), rank=int(spec["rank_offset"]),
            world_size=int(spec["world_size"]), group_name=str(spec["group_name"]),
            timeout_s=float(spec.get("timeout_s", DEFAULT_TIMEOUT_S))))
        self._group_name, self._device = str(spec["group_name"]), device

    async def receive(self, engine: Any, payload: Any) -> Any:
        """See :meth:`WeightSync.receive`: every bucket broadcast into new tensors on the
        engine's device, in a thread; for an engine whose server is the member, the manifest
        (its :meth:`load` has the server receive).

        Raises:
            WeightSyncError: a push for another group than this engine's, or a failed broadcast.
        """
        if not isinstance(payload, Mapping) or payload.get("group") != self._group_name \
                or not self._group_name:
            shown = payload.get("group") if isinstance(payload, Mapping) else payload
            raise WeightSyncError(f"weight sync 'dist': a push for group {shown!r}, but this "
                                  f"engine is in {self._group_name or 'no group'!r}")
        if self._engine is not None:
            return payload
        group, device, buckets = self._group, self._device, payload["buckets"]

        def receive_all() -> dict[str, torch.Tensor]:
            tensors: dict[str, torch.Tensor] = {}
            for spec in buckets:
                tensors.update(dist_group.receive_bucket(spec, group, device))
            return tensors

        self._transfer = in_daemon_thread(receive_all)
        return await self._transfer

    def load(self, engine: Any, received: Any, version: int) -> None:
        """See :meth:`WeightSync.load`: the received tensors into the engine; an engine whose
        server is the member gets the manifest (``load_weights_from_distributed``)."""
        own = getattr(engine, "load_weights_from_distributed", None)
        if own is not None and self._engine is engine:
            own(received, version=version)
            return
        engine.load_weights(received, version=version)

    def leave(self) -> None:
        """Leave the current group (engine side); an engine's server leaves through
        ``destroy_weights_update_group`` when it has one."""
        self._drop_group()
        if self._engine is not None:
            destroy = getattr(self._engine, "destroy_weights_update_group", None)
            if destroy is not None:
                try:
                    destroy(self._group_name)
                except Exception:  # noqa: BLE001  (leaving is best effort: the server may be gone)
                    pass
            self._engine = None
        self._group_name = ""
