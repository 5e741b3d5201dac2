"""The engine actor: hosts any rollout engine (:mod:`replayrl.rollout.engines`) in its own process.

It is built from the engine's ``"module:Class"`` path (resolved from the registry by the
launcher) and the engine's constructor kwargs, and serves two requests: ``load_weights`` (a
weight push of one policy version) and ``generate`` (one turn per prompt). Every reply to
``generate`` carries the version the engine served, which becomes each sample's
``policy_version``. Readiness ("no request before the first weight load") is the engine
interface's rule (:meth:`replayrl.rollout.engines.base.Engine.generate`), so it holds for every engine.

A push arrives packed by the run's weight sync (:mod:`replayrl.rollout.weight_sync`): an array
bundle (zmq, shm), or a manifest naming its sync (disk, dist, ipc), which this actor hands to
that sync's engine half; ``join_weight_group`` sets up the receiving end of a sync that needs
one (dist: the trainer's weight group).

``load_weights`` is served concurrently with queued ``generate`` requests, and ``generate`` may
name the ``min_version`` it must be served at: the trainer can then push and go on training
while the engine loads, and a generation requested for the new policy waits here for it
instead of the driver waiting for the push (docs/design/version-clock.md#version-clock). Both run
synchronously inside, so a load never lands in the middle of a generation.

A multi-turn episode spans several ``generate`` calls; it holds a version pin
(:mod:`replayrl.rollout.episodes.version_pins`) from :meth:`EngineActor.open_pin` to
:meth:`EngineActor.release_pin`, and a load of a newer version waits until no pin of an older
one is held, so the episode's turns all come from the weights it started with. Nothing else
waits for pins: a run without them (single-turn) loads exactly as before.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping

import numpy as np
import torch

from replayrl.actors import Actor, concurrent
from replayrl.actors.heap import HeapKeeper
from replayrl.rollout.engines import check_capture, load_engine_class
from replayrl.rollout.engines.base import generations_to_columns
from replayrl.rollout.episodes.version_pins import VersionPins
from replayrl.rollout.errors import EngineError, EngineNotReady
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.weight_sync import resolve_weight_sync
from replayrl.rollout.weight_sync.base import WeightSync, sync_name


class EngineActor(Actor):
    """Actor around one :class:`replayrl.rollout.engines.base.Engine`.

    Args:
        engine_class: ``"module:Class"`` of an ``Engine`` subclass (``replayrl.rollout.engines.ENGINES``).
        engine_kwargs: the engine's constructor keyword arguments (plain data).
        traces: the trace fields every ``generate`` captures: the run's required traces
            (``replayrl.rollout.sample.required_traces``), no more, no less.
        torch_threads: intra-op threads for this process (the trainer runs beside it).
        version_wait_s: the longest a ``generate`` with ``min_version`` waits for that version.
        pin_lease_s: seconds a version pin outlives its holder's silence while the engine is
            idle (:class:`replayrl.rollout.episodes.version_pins.VersionPins`); keep it well below the
            trainer's ``--rpc-timeout-seconds``, which bounds a load held by pins.

    Raises:
        replayrl.rollout.engines.EngineError: ``engine_class`` is not an importable ``Engine`` subclass.
        replayrl.rollout.engines.EngineCaptureError: the engine cannot capture one of ``traces``.
    """

    def __init__(self, engine_class: str, engine_kwargs: Mapping[str, Any], traces: list[str],
                 torch_threads: int = 1, version_wait_s: float = 300.0,
                 pin_lease_s: float = 60.0) -> None:
        torch.set_num_threads(torch_threads)
        self.heap = HeapKeeper()  # large generates keep their freed blocks (actors/heap.py)
        cls = load_engine_class(engine_class)
        self.traces = tuple(sorted(check_capture(cls, traces)))  # fail at start, not mid-run
        self.engine = cls(**dict(engine_kwargs))
        self.version_wait_s = version_wait_s
        self._loaded: asyncio.Event | None = None  # set after every load attempt, then renewed
        self._failed: tuple[int, str] | None = None  # (version, error) of the last failed load
        self.pins = VersionPins(pin_lease_s)  # multi-turn episodes across a push
        self._syncs: dict[str, WeightSync] = {}  # the engine halves of the weight syncs used

    async def on_stop(self) -> None:
        """Leave a weight group, and release the engine's resources (an HTTP session, a
        temporary weight directory) when it has a ``close``."""
        for sync in self._syncs.values():
            sync.leave()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def _sync(self, name: str) -> WeightSync:
        """The engine half of weight sync ``name`` (made on first use)."""
        if name not in self._syncs:
            self._syncs[name] = resolve_weight_sync(name)()
        return self._syncs[name]

    @concurrent
    async def join_weight_group(self, spec: Mapping[str, Any]) -> bool:
        """Join the trainer's weight group (``--weight-sync dist``), leaving any earlier one;
        returns once every member joined (:meth:`replayrl.rollout.weight_sync.dist.DistSync.join`).

        Args:
            spec: ``master_address``, ``master_port``, ``rank_offset`` (this engine's rank),
                ``world_size``, ``group_name``, ``backend`` and ``timeout_s``.
        Raises:
            replayrl.rollout.errors.WeightSyncError: the group did not form in time.
        """
        await self._sync("dist").join(self.engine, spec)
        return True

    @concurrent
    async def load_weights(self, version: int, weights: Mapping[str, Any]) -> float:
        """Load a full weight set of policy ``version``; returns seconds spent receiving and
        loading.

        The data is received first (a dist push takes part in the broadcast at once, while
        generations go on); the load then waits for earlier loads and until no version pin of
        an older version is held (:meth:`open_pin`; a pin lapses after ``pin_lease_s`` unused),
        so a multi-turn episode in flight finishes on its weights; without pins it starts at once.

        Args:
            weights: the push as its weight sync packed it
                (:func:`replayrl.rollout.weight_sync.base.sync_name`): the arrays as one bundle
                (``replayrl.transport.array_bundle``: a hundred small frames cost far more to
                send than one), or a manifest of the disk, dist or ipc sync.
        Raises:
            replayrl.transport.DecodeError: a malformed bundle (nothing loaded).
            replayrl.rollout.errors.WeightSyncError: a payload of no sync, or of another
                weight group; a failed broadcast.
            replayrl.rollout.engines.EngineInputError: ``version`` is below the version already loaded.
            Whatever the engine's weight loading raises (previous weights stay).
        """
        start = time.perf_counter()
        try:
            sync = self._sync(sync_name(weights))
            received = await sync.receive(self.engine, weights)
            async with self.pins.exclusive(version):
                sync.load(self.engine, received, version)
                self._failed = None
        except Exception as exc:
            self._failed = (version, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if self._loaded is not None:
                self._loaded.set()
                self._loaded = None
        return time.perf_counter() - start

    @concurrent
    async def open_pin(self, pin: str, min_version: int | None = None) -> int:
        """Pin the version the engine serves for a multi-turn episode batch until
        :meth:`release_pin`: no newer weights load meanwhile (docs/design/version-clock.md#version-clock).

        Waits first for ``min_version`` (as :meth:`generate`) and for any load already waiting
        or loading, so a pending push lands before the episode starts, never during it.

        Args:
            pin: the holder's id, unique among the pins held (e.g. ``"rollout_manager:17"``).
            min_version: pin this policy version or a later one.
        Returns:
            the pinned version: every ``generate`` naming ``pin`` is served at it, unless the
            pin lapsed (``pin_lease_s``).
        Raises:
            replayrl.rollout.engines.EngineNotReady: no weights loaded yet, or ``min_version``
                did not arrive within ``version_wait_s``.
            replayrl.rollout.engines.EngineError: the load of a version ``>= min_version`` failed.
            replayrl.rollout.engines.EngineInputError: ``pin`` is empty or already held.
        """
        if min_version is not None:
            await self._wait_for_version(min_version)
        await self.pins.no_load()
        if self.engine.version is None:
            raise EngineNotReady("open_pin before the first weight load of the run")
        self.pins.open(pin, self.engine.version)
        return int(self.engine.version)

    @concurrent
    async def release_pin(self, pin: str) -> bool:
        """End the episode batch of ``pin``: a load it held back may go on. Idempotent;
        returns whether the pin was still held (``False`` after it lapsed)."""
        return self.pins.release(pin)

    async def _wait_for_version(self, min_version: int) -> None:
        """Return once the engine serves ``min_version`` or later.

        Raises:
            replayrl.rollout.engines.EngineError: the push of a version ``>= min_version`` failed here.
            replayrl.rollout.engines.EngineNotReady: no such version within ``version_wait_s``.
        """
        deadline = time.monotonic() + self.version_wait_s
        while self.engine.version is None or self.engine.version < min_version:
            if self._failed is not None and self._failed[0] >= min_version:
                raise EngineError(f"generate needs weights of version {min_version}, whose "
                                  f"load failed here: {self._failed[1]}")
            if self._loaded is None:
                self._loaded = asyncio.Event()
            try:
                await asyncio.wait_for(self._loaded.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise EngineNotReady(f"generate waited {self.version_wait_s} s for weights of "
                                     f"version {min_version}; serving {self.engine.version}") from None

    async def generate(self, prompts: list[np.ndarray], sampling: dict, *, max_new_tokens: int,
                       eos_token_id: int, seed: int, min_version: int | None = None,
                       pin: str | None = None) -> dict:
        """Generate one turn per prompt, capturing this actor's ``traces``.

        Args:
            prompts: ``B >= 1`` int token-id arrays (each the whole context of its turn).
            sampling: :class:`replayrl.rollout.sampling.sampling_params.SamplingParams` fields.
            max_new_tokens, eos_token_id, seed: as :meth:`replayrl.rollout.engines.base.Engine.generate`.
            min_version: serve only at this policy version or later: wait (up to
                ``version_wait_s``) for a push still on its way.
            pin: the version pin (:meth:`open_pin`) of the episode batch this turn belongs to;
                ``None`` for a call outside one. A held pin's version is the one served (a
                lapsed or unknown pin is served at the engine's version; the reply says which).

        Returns:
            ``{"version": int, "generations": replayrl.rollout.engines.base.generations_to_columns(...)}``.

        Raises:
            replayrl.rollout.engines.EngineNotReady: no weights loaded yet in this run, or
                ``min_version`` did not arrive in time.
            replayrl.rollout.engines.EngineError (and subclasses): the engine rejected the request.
        """
        if min_version is not None:
            await self._wait_for_version(min_version)
        self.pins.touch(pin)  # a turn of a pinned episode (pin=None: none)
        try:
            with self.heap.watch():
                gens = self.engine.generate([np.asarray(p).tolist() for p in prompts],
                                            SamplingParams(**sampling), max_new_tokens=max_new_tokens,
                                            eos_token_id=eos_token_id, seed=seed, traces=self.traces)
        finally:
            self.pins.served()
        return {"version": self.engine.version, "generations": generations_to_columns(gens)}
