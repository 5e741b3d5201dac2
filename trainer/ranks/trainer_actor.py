"""The TrainerActor: preflight, RS gate / exact refill, GRPO + decoupled PPO/TIS update, weight push.

One call of :meth:`TrainerActor.train` is one optimizer step on one rollout batch:

1. take the batch from the RolloutManager (trajectories cross the wire once);
2. ask the VersionClock to admit every sample (``0 <= t - v <= max_staleness``);
3. preflight forward at the weights the step starts from -> proximal logprobs in the
   (pinned when possible) :class:`ProximalLogprobCache`, and the replay flip / drift rates;
4. RS gate (:class:`replayrl.trainer.rejection.rs_policy.RSGate`); with exact refill, whole prompt
   groups are admitted or dropped and replacements are generated at exactly the preflight
   version until ``rollout_batch_size`` groups are admitted or ``--rs-refill-max-rounds`` is
   spent, in which case the step raises before the optimizer is touched
   (:class:`replayrl.trainer.rejection.refill.RefillCoordinator`, which gets the cache, the preflight and
   the actor refs, not this actor); with ``--dynamic-sampling`` groups whose rewards are all
   equal are dropped and refilled the same way (without an RS gate: no preflight, the update
   is fused);
5. GRPO advantages over the trained groups (with RS and no refill, each group's baseline over
   the samples the gate accepted; a group with fewer than two trains on nothing), loss
   forward/backward per microbatch with the same replays and the same gate re-applied, clip,
   optimizer step, ``trainer_version += 1``.

A step with nothing to train (no loss token, none accepted, or no group with a baseline) is
skipped before any forward of the update: weights, optimizer moments and the version stay as
they are and the metrics say ``skipped: 1`` and why (``skip_reason``), whichever
``--rs-denominator``; with ``--stop-on-empty-step`` it raises :class:`EmptyStep` instead
(docs/design/rejection-sampling.md#rejection-sampling).

Everything that touches the weights or the optimizer (forwards, backward, clip + step, weight
export, checkpoints) goes through the backend chosen by ``--train-backend``
(:class:`replayrl.trainer.backends.base.TrainerBackend`); this actor only orchestrates.
:meth:`push_weights` sends the backend's full weight set to every engine through the run's
weight sync (:mod:`replayrl.rollout.weight_sync`: packed here, loaded by each engine) and records
each engine's new version with the clock. The loop that orders these calls lives in
``tools/run/train_loop.py`` (slime's ``train_async.py`` shape).
"""
from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import numpy as np
import torch

from replayrl.actors import Actor
from replayrl.actors.errors import PeerLost
from replayrl.actors.proxy import ActorProxy
from replayrl.rollout.sample import Sample, samples_from_columns, samples_to_columns, trace_bytes_per_token
from replayrl.rollout.weight_sync import resolve_weight_sync
from replayrl.rollout.weight_sync.base import Delivery, Packed, WeightSync
from replayrl.trainer.backends import resolve_backend
from replayrl.trainer.backends.base import TrainerBackend
from replayrl.trainer.batching.batch import token_counts
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import EmptyStep, TrainerConfigError, TrainStepError
from replayrl.trainer.loss.advantages import baseline_groups, grpo_advantages
from replayrl.trainer.loss.entropy_baseline import mean_surprisal
from replayrl.trainer.loss.entropy_control import EntropyControl
from replayrl.trainer.ranks.rank_group import RankGroup, follower_names, shard
from replayrl.trainer.ranks.rank_step import UPDATE_SUMS, RankStep
from replayrl.trainer.rejection.refill import RefillCoordinator, gate_metrics
from replayrl.trainer.replay.checks import mean_rates
from replayrl.transport import strict_json

__all__ = [ "SKIP_REASONS", "TrainerActor"]


ENTROPY_CONTROL_FILE = "entropy_control.json"
"""The adaptive entropy controller's state in a checkpoint directory (written by rank 0, only
with ``--entropy-target``: a fixed coefficient has no state, and the warmup follows the
restored policy version)."""

SKIP_REASONS = ("no_loss_tokens", "no_accepted_tokens", "no_group_baseline")
"""``skip_reason`` of a skipped step: the batch has no loss token; the RS gate kept none; every
prompt group has fewer than two accepted samples (no baseline, docs/design/rejection-sampling.md#rejection-sampling)."""


async def _no_preflight(samples: list[Sample]) -> dict[str, list[float]]:
    """The refill preflight of a step without one (dynamic sampling, no RS gate): nothing
    cached, no replay rates; the fused update forwards the admitted samples itself."""
    return {}


def _clock_arguments(columns: object) -> tuple[list[int], list[int]] | None:
    """``(sample ids, policy versions)`` of a batch still in columns, for the clock's
    ``check_samples`` while the batch decodes; ``None`` when the two columns are not int
    arrays ``[N]`` of one length (the decode then names the fault, and the clock is asked
    after it, with the samples)."""
    try:
        ids, versions = np.asarray(columns["sample_id"]), np.asarray(columns["policy_version"])
    except (KeyError, TypeError, ValueError):
        return None
    if ids.ndim != 1 or ids.shape != versions.shape or not (ids.dtype.kind in "iu"
                                                             and versions.dtype.kind in "iu"):
        return None
    return ids.tolist(), versions.tolist()


async def _lost_during(delivery: Delivery) -> set[str]:
    """Wait until a group push completed, or until an engine of it is lost; the engines whose
    call failed with :class:`PeerLost` (empty once everything finished without a loss). Calls
    left running keep a callback that retrieves their error, so none is logged as lost."""
    calls = dict(delivery.loads)
    waiting: set[asyncio.Future] = {*calls.values(), delivery.transfer}
    while waiting:
        _, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_EXCEPTION)
        lost = {e for e, f in calls.items()
                if f.done() and not f.cancelled() and isinstance(f.exception(), PeerLost)}
        if lost:
            for f in waiting:  # the others of the broken group finish (or time out) unawaited
                f.add_done_callback(lambda f: f.cancelled() or f.exception())
            return lost
    return set()


class TrainerActor(Actor):
    """Actor that orchestrates the steps; the policy and its optimizer live in its backend.

    The backend (``--train-backend``, :mod:`replayrl.trainer.backends`) owns the weights and runs the
    forwards, backward, clip + optimizer step, weight export and checkpoints; this actor owns
    the proximal-logprob cache, the RS gate and everything between the actors.

    With ``ranks`` (``--dp-size N > 1``) this actor is rank 0 of ``N`` trainer ranks
    (docs/design/trainer-ranks.md#trainer-ranks): it joins their process group before building its
    backend, makes every whole-batch decision, and gives each data-parallel rank its
    contiguous share of every preflight and update through the ``trainer_1 ..`` actors
    (:class:`replayrl.trainer.ranks.trainer_rank.TrainerRank`), running its own share meanwhile. Weights are
    pushed from here alone.

    Args:
        checkpoint_dir: Hugging Face checkpoint directory of the initial policy.
        config: :meth:`TrainerConfig.to_dict` output.
        n_samples_per_prompt: group size for GRPO.
        engines: engine actor names to push weights to.
        rollout_batch_size: prompt groups per step (the exact-refill target).
        vocab_tokens: the tokenizer vocabulary written with checkpoints.
        manager: RolloutManager actor name; clock: VersionClock actor name.
        engine_failure: ``--engine-failure``; with ``regenerate`` or ``restart`` a weight push
            goes on without an engine lost during it (:meth:`_record_loads`).
        ranks: ``{"size", "host", "port"}`` of the trainer ranks' group
            (:class:`replayrl.trainer.ranks.rank_group.RankGroup` without ``rank``); None: one rank.
        weight_sync: ``{"name", "settings"}`` of the run's weight sync (``--weight-sync``
            resolved, :mod:`replayrl.rollout.weight_sync`); None: ``shm`` (the shared-memory
            pool for ipc engines when it is on, ZeroMQ frames otherwise).

    Raises:
        replayrl.trainer.config.TrainerConfigError: a bad setting (e.g. an unknown ``--train-backend``).
        replayrl.rollout.model.CheckpointError: an unreadable ``checkpoint_dir``.
    """

    def __init__(self, checkpoint_dir: str, config: dict, n_samples_per_prompt: int,
                 engines: list[str], rollout_batch_size: int, vocab_tokens: list[str],
                 manager: str = "rollout_manager", clock: str = "version_clock",
                 engine_failure: str = "fail", ranks: dict | None = None,
                 weight_sync: dict | None = None) -> None:
        self.config = TrainerConfig(**config)
        self.followers: list[str] = []
        if ranks is not None and ranks["size"] > 1:
            RankGroup(rank=0, timeout_s=self.config.rpc_timeout_s, **ranks).join()
            self.followers = follower_names(ranks["size"])
        self._dp_ranks: list[int] | None = None  # data-parallel rank of every trainer rank
        backend = resolve_backend(self.config.train_backend)(checkpoint_dir, self.config,
                                                             vocab_tokens)
        if backend.data_parallel()[1] != self.config.dp_size:
            # the refill quantum is computed from --dp-size: it must be the real one
            raise TrainerConfigError(f"--dp-size {self.config.dp_size}, but the trainer ranks "
                                     f"form {backend.data_parallel()[1]} data-parallel ranks")
        self.local = RankStep(backend, self.config)  # rank 0's share of every step
        self.backend, self.cache = backend, self.local.cache
        self.n = n_samples_per_prompt
        self.rollout_batch_size = rollout_batch_size
        self.engines, self.manager_name, self.clock_name = list(engines), manager, clock
        self.engine_failure = engine_failure  # whether a push survives a lost engine
        self.version = 0
        cfg = self.config
        self.entropy = EntropyControl(cfg.entropy_coef, cfg.entropy_target, cfg.entropy_coef_step,
                                      warmup=cfg.entropy_coef_warmup_steps)
        self._push: asyncio.Future | None = None  # the weight push still in flight, if any
        self._pushed_base = False  # LoRA: whether the engines hold the base weights (first push)
        self.weight_sync = dict(weight_sync or {"name": "shm"})
        self._sync: WeightSync | None = None  # its trainer half (made on first use: `sync`)
        self._lost: set[str] = set()  # engines lost and not restored (no member of a group sync)
        self.required_traces = self.local.required_traces

    @property
    def gate(self):
        """The RS gate (:class:`replayrl.trainer.rejection.rs_policy.RSGate`) of the preflight decision
        and of its re-check in the update."""
        return self.local.gate

    @gate.setter
    def gate(self, value) -> None:
        self.local.gate = value

    # -- the other trainer ranks ---------------------------------------------------------------
    def _rank(self, name: str):
        return self.proxy(name, self.config.rpc_timeout_s)

    async def _on_ranks(self, local, calls: list) -> tuple[object, list]:
        """Run ``local()`` here while the other ranks run ``calls`` (awaitables, one per
        follower); returns ``(local result, their results)``. With followers, ``local`` runs
        in a worker thread: it may block in a collective that needs their calls, which this
        event loop must go on sending and answering."""
        if not self.followers:
            return local(), []
        remote = [asyncio.ensure_future(c) for c in calls]
        try:
            mine, *theirs = await asyncio.gather(asyncio.to_thread(local), *remote)
        except BaseException:
            for r in remote:
                r.cancel()
            raise
        return mine, theirs

    async def _data_parallel_ranks(self) -> list[int]:
        """The data-parallel rank of trainer ranks ``0 .. N-1`` (asked once; model-parallel
        ranks of one data-parallel rank share its data)."""
        if self._dp_ranks is None:
            theirs = await asyncio.gather(*(self._rank(f).data_parallel() for f in self.followers))
            self._dp_ranks = [self.backend.data_parallel()[0], *(int(r[0]) for r in theirs)]
        return self._dp_ranks

    async def _shares(self, samples: list[Sample], exact: bool) -> tuple[list, list[int], set[int]]:
        """``(shares by data-parallel rank, dp rank of every trainer rank, the trainer ranks
        whose results stand for their dp rank)``: the first trainer rank of each."""
        dp_ranks = await self._data_parallel_ranks()
        shares = shard(samples, self.backend.data_parallel()[1], exact=exact)
        first = {d: i for i, d in reversed(list(enumerate(dp_ranks)))}
        return shares, dp_ranks, set(first.values())

    # -- weights -----------------------------------------------------------------------------
    async def on_stop(self) -> None:
        """Leave the weight sync's group, if it formed one."""
        if self._sync is not None:
            self._sync.close()

    @property
    def sync(self) -> WeightSync:
        """The run's weight sync (:mod:`replayrl.rollout.weight_sync`, ``--weight-sync``), its
        trainer half made on first use (it needs this actor's endpoint)."""
        if self._sync is None:
            endpoint = self.directory.endpoints.get(self.name, "") if self.directory else ""
            self._sync = resolve_weight_sync(self.weight_sync["name"])(
                endpoint=endpoint, **self.weight_sync.get("settings", {}))
        return self._sync

    def _engine(self, name: str) -> ActorProxy:
        return self.proxy(name, self.config.rpc_timeout_s)

    async def push_weights(self, wait: bool = True) -> dict:
        """Send the current weights (version = optimizer steps applied) to every engine.

        Args:
            wait: return once every engine loaded them and the VersionClock recorded it. With
                ``False`` return once they are sent (the weight sync copied them, or sends them
                by handle and moves them before the trainer next writes them, so training may
                go on): the engines load them while the trainer trains, and a
                ``generate`` asking for this ``min_version`` waits for the load. The next push
                (or :meth:`wait_for_push`) waits for this one first and raises its error.
        Returns:
            ``{"version", "bytes", "seconds"}`` (seconds until sent, or until loaded with
            ``wait``).
        """
        await self.wait_for_push()
        start = time.perf_counter()
        packed = self.sync.pack(await self._push_tensors(full=not self._pushed_base),
                                version=self.version, home=self.backend)
        self._pushed_base = True
        delivery = await self.sync.deliver(packed, self.version, self.engines, self._engine,
                                           lost=self._lost)
        self._push = asyncio.ensure_future(self._complete(packed, delivery, self.version))
        # its error is raised by the next push / wait_for_push; a run that ends first (the
        # supervisor reports the lost engine) must not also log it as never retrieved
        self._push.add_done_callback(lambda f: f.cancelled() or f.exception())
        if wait:
            await self.wait_for_push()
        else:
            await asyncio.sleep(0)  # let the load calls reach their sockets before training
        return {"version": self.version, "bytes": packed.nbytes,
                "seconds": time.perf_counter() - start}

    async def _push_tensors(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The tensors of a push (:meth:`TrainerBackend.push_tensors`); when the other ranks
        hold parts of them, they take part in the gather and send nothing. Under LoRA
        (``--lora-rank``) only the adapters unless ``full`` (the first push, a restarted
        engine): the engines keep the base weights (rollout/model/adapters.py)."""
        if self.backend.collective_io:
            tensors, _ = await self._on_ranks(lambda: self.backend.push_tensors(full),
                                              [self._rank(f).push_tensors(full) for f in self.followers])
            return tensors
        return self.backend.push_tensors(full)

    async def _complete(self, packed: Packed, delivery: Delivery, version: int) -> None:
        """Await every engine's load (and the sync's own transfer), then record the ones that
        loaded with the clock.

        Under ``--engine-failure regenerate`` / ``restart`` an engine lost during the push
        (:class:`replayrl.actors.errors.PeerLost`) is skipped: the rollout manager takes it out of its
        pool, and a restarted one gets the weights of the moment it serves again
        (:meth:`push_weights_to`). A group sync (dist) that loses a member mid-push leaves the
        others waiting on its broadcast: the push is delivered again at once to the engines
        left, in a group formed without the lost one. Any other error, or any loss under
        ``fail``, is raised.
        """
        while delivery.transfer is not None and self.engine_failure != "fail":
            lost = await _lost_during(delivery)
            if not lost:
                break
            self._lost |= lost
            delivery = await self.sync.deliver(packed, version, self.engines, self._engine,
                                               lost=self._lost)
        results = await asyncio.gather(*delivery.loads.values(), return_exceptions=True)
        failed = None
        if delivery.transfer is not None:
            failed = (await asyncio.gather(delivery.transfer, return_exceptions=True))[0]
        if self.engine_failure != "fail":
            self._lost |= {e for e, r in zip(delivery.loads, results) if isinstance(r, PeerLost)}
        if isinstance(failed, BaseException):
            raise failed
        clock = self.proxy(self.clock_name, self.config.rpc_timeout_s)
        for e, result in zip(delivery.loads, results):
            if isinstance(result, PeerLost) and self.engine_failure != "fail":
                continue
            if isinstance(result, BaseException):
                raise result
            await clock.record_engine_load(e, version)

    async def push_weights_to(self, engine: str) -> dict:
        """Load the current weights into one engine and record it with the clock: a restarted
        engine (``--engine-failure restart``) serves only after this. A group sync (dist) that
        reaches every engine at once brings this one up to date through the zmq sync, and takes
        it into its group at the next push.

        Ordered like every trainer call, so it runs between steps: the weights are those of
        the trainer's current version, which the clock admits for any batch generated from now
        on (docs/design/engine-faults.md#engine-faults).

        A push still in flight is finished first (and its error raised here): its load may
        reach the new process, and must be recorded before this newer version.

        Returns:
            ``{"version", "bytes", "seconds"}`` as :meth:`push_weights`.
        Raises:
            ValueError: ``engine`` is not one of the run's engines.
            replayrl.actors.ActorTimeout: the engine not reachable within ``--rpc-timeout-seconds``.
            replayrl.actors.RemoteError / replayrl.actors.ActorError: the load or the record failed.
        """
        if engine not in self.engines:
            raise ValueError(f"unknown engine {engine!r}; the run's engines: {self.engines}")
        start = time.perf_counter()
        # a push still in flight (push_weights(wait=False)) may have sent its load to this
        # engine's endpoint before the loss was seen, and the new process answers it: recorded
        # after this newer version, the clock would see the engine move backwards (a chaos
        # soak's VersionRegression). Finishing it first keeps the loads and records in order.
        await self.wait_for_push()
        sync = self.sync
        if sync.collective:  # a new process: no member of the group its predecessor was in
            sync.close()
            sync = resolve_weight_sync("zmq")()
        packed = sync.pack(await self._push_tensors(), version=self.version, home=self.backend)
        timeout = self.config.rpc_timeout_s
        await self.ref(engine).reachable(timeout)  # this process's connection to the new one
        delivery = await sync.deliver(packed, self.version, [engine], self._engine)
        await delivery.loads[engine]
        if delivery.transfer is not None:
            await delivery.transfer
        await self.proxy(self.clock_name, timeout).record_engine_load(engine, self.version)
        self._lost.discard(engine)
        return {"version": self.version, "bytes": packed.nbytes,
                "seconds": time.perf_counter() - start}

    async def wait_for_push(self) -> None:
        """Return once the last push finished (loaded and recorded); re-raise its error.

        Raises:
            replayrl.actors.RemoteError / replayrl.actors.ActorTimeout: an engine or the clock failed the push.
        """
        push, self._push = self._push, None
        if push is not None:
            await push

    # -- one step ----------------------------------------------------------------------------
    def preflight(self, samples: list[Sample]) -> dict[str, list[float]]:
        """Proximal logprobs of ``samples`` at the current weights into the cache (this rank).

        Returns the replay rates, one value per microbatch (NaN when it has no captured real
        row; :func:`replayrl.trainer.replay.checks.mean_rates` makes the step metrics): ``*_flip_rate`` =
        fraction of captured rows where the trainer used other experts / keys than the engine
        (0 when the replay works), ``*_drift_rate`` = where the trainer's own router / indexer
        would have chosen differently (numerics plus policy change since the sample was
        generated). Keys ``routing_*`` / ``indexer_*`` appear only when the samples carry that
        trace.

        Raises:
            replayrl.rollout.errors.MissingTraceError: a sample lacks a trace an enabled replay needs
                (``replayrl.rollout.sample.required_traces``); names the sample and the field.
            replayrl.trainer.replay.checks.ReplayMismatch: the engine's and the trainer's own choices disagree
                beyond that kind's bounds (:meth:`TrainerConfig.replay_bounds`).
            replayrl.trainer.ranks.proximal_cache.ProximalCacheError: the cache's byte cap is exceeded.
        """
        return self.local.preflight(samples)

    async def preflight_ranks(self, samples: list[Sample]) -> dict[str, list[float]]:
        """:meth:`preflight` over every trainer rank: each data-parallel rank forwards its
        share; the logprobs of all come into this rank's cache (the RS gate decides on the
        whole batch here), the rates in rank order. With one rank, :meth:`preflight`.

        Raises:
            as :meth:`preflight`; replayrl.actors.RemoteError: another rank raised it.
        """
        if not self.followers:
            return self.preflight(samples)
        # a backend whose forwards are collectives needs equal shares (a batch that does not
        # split evenly is refused, not left to hang in a collective)
        shares, dp_ranks, firsts = await self._shares(samples,
                                                      exact=self.backend.collective_forward)
        calls = [self._rank(f).preflight(samples_to_columns(shares[dp_ranks[i]]))
                 for i, f in enumerate(self.followers, start=1)]
        rates, theirs = await self._on_ranks(lambda: self.preflight(shares[dp_ranks[0]]), calls)
        for i, result in enumerate(theirs, start=1):
            if i not in firsts or dp_ranks[i] == dp_ranks[0]:
                continue  # a model-parallel peer of a share already counted
            share = shares[dp_ranks[i]]
            logprobs = torch.from_numpy(np.array(result["logprobs"], np.float32))
            for s, part in zip(share, torch.split(logprobs, [len(s.response_ids) for s in share])):
                self.cache.put(s.sample_id, part)
            for name, values in result["rates"].items():
                rates.setdefault(name, []).extend(values)
            if len(result["entropy"]):
                self.local.entropies.append(torch.from_numpy(np.array(result["entropy"], np.float32)))
        return rates

    def needs_preflight(self) -> bool:
        """Whether a step runs the separate preflight forward before its update.

        Only an RS gate (and with it exact refill) or a replay check
        (``--replay-min-overlap-ratio`` / ``--replay-max-mismatch-fraction``, their
        ``--indexer-replay-*`` counterparts: :attr:`TrainerConfig.replay_check_on`) need the
        proximal logprobs or the choices before the update. Otherwise, with one optimizer step
        per rollout, the proximal logprobs ARE the detached logprobs of the training forward at
        the same weights, and the flip / drift rates come from that forward: one forward per
        microbatch instead of two (``--preflight always`` keeps the separate one).
        """
        cfg = self.config
        return (cfg.preflight == "always" or self.gate.active
                or cfg.replay_check_on
                or type(self.backend).train_forward is TrainerBackend.train_forward)

    async def train(self, rollout_id: int) -> dict:
        """One optimizer step on rollout ``rollout_id``; returns float metrics.

        Raises:
            replayrl.actors.RemoteError: the clock rejected a stale sample, or the manager has no batch.
            replayrl.rollout.errors.SampleError: a malformed trajectory (named).
            replayrl.trainer.rejection.refill_planner.RefillExhausted: too few admitted groups (nothing applied).
            TrainStepError: a non-finite gradient, or a training forward that does not
                reproduce the preflight gate (nothing applied).
            EmptyStep: nothing to train and ``--stop-on-empty-step`` (nothing applied).

        A step with nothing to train (:data:`SKIP_REASONS`) without ``--stop-on-empty-step``
        applies nothing, keeps the version and returns ``skipped: 1``, ``skip_reason``, the
        token and group counts and the staleness figures, without the update's figures
        (``grad_norm``, ``clipfrac``, ...). Every row has ``skipped`` (0 or 1) and
        ``rs_degenerate_groups`` (prompt groups with fewer than two accepted samples).
        """
        cfg = self.config
        clock = self.proxy(self.clock_name, cfg.rpc_timeout_s)
        start = time.perf_counter()
        raw = await self.proxy(self.manager_name, cfg.rpc_timeout_s).take_batch(rollout_id)
        # the clock's staleness check travels while the batch decodes (it needs only the ids
        # and versions); a batch that does not decode raises its own error, the check dropped
        early = _clock_arguments(raw)
        check = asyncio.ensure_future(clock.check_samples(*early)) if early else None
        try:
            if check is not None:
                await asyncio.sleep(0)  # the task sends the call now, not after the decode
            samples = samples_from_columns(raw, decode_threads=cfg.trace_decode_threads)
            transport_seconds = time.perf_counter() - start  # the batch's RPC, decode and checks
            wire = trace_bytes_per_token(raw)  # the traces' bytes as they came, still encoded
        except BaseException:
            if check is not None:  # its reply, when it comes, is dropped
                check.cancel()
                await asyncio.gather(check, return_exceptions=True)
            raise
        trainer_version = await (check if check is not None else clock.check_samples(
            [s.sample_id for s in samples], [s.policy_version for s in samples]))
        if trainer_version != self.version:
            raise TrainStepError(f"clock says trainer version {trainer_version}, trainer holds "
                                 f"{self.version}")
        self.cache.reset_counters()
        self.local.entropies = []
        try:
            if self.needs_preflight():
                t0 = time.perf_counter()
                metrics = mean_rates(await self.preflight_ranks(samples))
                metrics["preflight_seconds"] = time.perf_counter() - t0
                admitted, token_accept, refill_metrics = await self._refill(
                    samples, self.preflight_ranks)
                metrics.update(refill_metrics)
                metrics.update(await self._update(admitted, token_accept))
            elif cfg.dynamic_sampling:  # no gate: refill by rewards alone, no proximal logprob
                metrics = {"preflight_seconds": 0.0}
                admitted, token_accept, refill_metrics = await self._refill(samples, _no_preflight)
                metrics.update(refill_metrics)
                metrics.update(await self._update(admitted, token_accept, fused=True))
            else:  # no gate: every token accepted, as RSGate("none") decides
                admitted, token_accept = samples, {s.sample_id: torch.ones(len(s.response_ids), dtype=torch.bool)
                                                   for s in samples}
                metrics = {"preflight_seconds": 0.0,
                           **gate_metrics(samples, [True] * len(samples), token_accept)}
                metrics.update(await self._update(admitted, token_accept, fused=True))
        finally:
            self.cache.clear()  # nothing survives a step, on success or error
        if not metrics["skipped"]:  # a skipped step applied nothing: the version stays
            self.version += 1
            await clock.set_trainer_version(self.version)
        seconds = time.perf_counter() - start
        metrics.update(rollout_id=rollout_id, trainer_version=self.version,
                       staleness_mean=float(np.mean([trainer_version - s.policy_version for s in admitted])),
                       staleness_max=int(max(trainer_version - s.policy_version for s in admitted)),
                       train_seconds=seconds, transport_seconds=transport_seconds,
                       effective_tokens_per_second=metrics["accepted_tokens"] / seconds, **wire)
        entropies = self.local.take_entropies()
        if entropies.numel():
            # the policy's entropy over the sampled support (docs/design/trainer-math.md#trainer-math),
            # mean over the sampled tokens of every sample this step forwarded at the
            # step's starting weights (with a preflight: refill candidates included)
            metrics["support_entropy_mean"] = float(entropies.mean())
        if not metrics["skipped"] and metrics["sampled_tokens"]:
            # the next step's bonus follows this step's entropy, estimated by the sampled
            # tokens' mean surprisal (support_entropy_mean is not measured on every path)
            self.entropy.observe(metrics["surprisal_mean"])
        return metrics

    async def _refill(self, samples: list[Sample], preflight) -> tuple[list[Sample], dict, dict]:
        """The step's admission and exact-refill rounds
        (:class:`replayrl.trainer.rejection.refill.RefillCoordinator`); ``preflight`` fills the
        cache for replacements (a no-op without an RS gate, where the update is fused)."""
        cfg = self.config
        coordinator = RefillCoordinator(
            self.gate, cfg, self.rollout_batch_size, self.n, cache=self.cache,
            preflight=preflight,
            manager=self.proxy(self.manager_name, cfg.rs_refill_rpc_timeout_s),
            clock=self.proxy(self.clock_name, cfg.rs_refill_rpc_timeout_s), version=self.version)
        return await coordinator.admit(samples)

    def _baseline(self, samples: list[Sample], token_accept: dict[int, torch.Tensor]
                  ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor], int]:
        """Which samples set their group's baseline, and the token masks the loss uses.

        A sample is in its group's baseline when its advantage reaches the loss: the gate
        accepted it whole, or (token mode) kept at least one of its sampled tokens (a synthetic
        EOS alone, which has no behaviour logprob, does not count). A group with
        fewer than two such samples has no baseline: the loss uses none of its tokens.

        Returns:
            ``(accepted, loss_accept, degenerate)``: bool [B] for :func:`grpo_advantages`
            (``None`` when RS is off: everything is accepted and nothing changes), the
            per-sample bool [R] token masks for the loss (the gate's, minus the groups without
            a baseline) and the number of those groups.
        """
        if not self.gate.active:
            return None, token_accept, 0
        accepted = torch.tensor([
            bool(token_accept[s.sample_id].all())
            or bool((token_accept[s.sample_id] & torch.from_numpy(np.asarray(s.sampled_mask) > 0)).any())
            for s in samples], dtype=torch.bool)
        in_group = torch.repeat_interleave(baseline_groups(accepted, self.n), self.n)
        loss_accept = {s.sample_id: token_accept[s.sample_id] & bool(ok)
                       for s, ok in zip(samples, in_group)}
        return accepted, loss_accept, int((~in_group).sum()) // self.n

    async def _update(self, samples: list[Sample], token_accept: dict[int, torch.Tensor],
                      fused: bool = False) -> dict:
        """The loss forward / backward per microbatch and the optimizer step, every
        data-parallel rank on its share (:meth:`replayrl.trainer.ranks.rank_step.RankStep.update`). ``fused``:
        no preflight ran; the proximal logprobs are this forward's, detached (same weights), and
        the replay rates come from it too (:meth:`needs_preflight`)."""
        cfg = self.config
        if not fused:
            self.cache.check_bijection([s.sample_id for s in samples])
        baseline, loss_accept, degenerate = self._baseline(samples, token_accept)
        loss_count, gate_count = token_counts(samples, token_accept)
        accepted_count = token_counts(samples, loss_accept)[1]
        loss_tokens, accepted = float(loss_count), float(accepted_count)
        sampled_tokens = float(sum(int(s.sampled_mask.sum()) for s in samples))
        groups = {"trained_groups": len(samples) // self.n - degenerate,
                  "rs_degenerate_groups": degenerate, "loss_tokens": loss_tokens,
                  "accepted_tokens": accepted, "sampled_tokens": sampled_tokens,
                  "synthetic_eos_samples": sum(s.synthetic_eos for s in samples)}
        if accepted_count == 0:  # nothing to train: no forward, no backward, no optimizer call
            reason = ("no_loss_tokens" if loss_count == 0 else
                      "no_accepted_tokens" if gate_count == 0 else "no_group_baseline")
            if cfg.stop_on_empty_step:
                raise EmptyStep(f"step has nothing to train ({reason}: {loss_count} loss tokens, "
                                f"{gate_count} accepted by the RS gate, {degenerate} of "
                                f"{len(samples) // self.n} prompt groups without a baseline); "
                                f"--stop-on-empty-step ends the run, nothing applied")
            return {"skipped": 1, "skip_reason": reason, **groups, "trained_groups": 0}
        denominator = loss_tokens if cfg.rs_denominator == "loss_tokens" else accepted
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        adv = grpo_advantages(rewards, self.n, normalize_std=cfg.normalize_advantage_std,
                              accepted=baseline)
        spread = rewards.reshape(-1, self.n)
        # prompt groups whose samples all scored the same: advantage 0, no reward gradient (the
        # entropy bonus still moves them; docs/design/trainer-math.md#entropy-collapse)
        signal = {"zero_advantage_group_fraction":
                  float((spread.amax(dim=1) == spread.amin(dim=1)).float().mean()),
                  "advantage_abs_mean": float(adv.abs().mean())}
        beta = self.entropy.at(self.version)  # this step's bonus, the same on every rank
        if beta and cfg.entropy_baseline:
            # the bonus's per-token reward -beta log pi(a) centred on the step's mean surprisal:
            # a constant per step, so it folds into every sample's advantage
            # (trainer/loss/entropy_baseline.py)
            surprisal = mean_surprisal([s.rollout_logprobs for s in samples], [
                loss_accept[s.sample_id].numpy() & (np.asarray(s.sampled_mask) > 0) for s in samples])
            adv = adv - beta * surprisal
            signal["entropy_baseline"] = surprisal
        if self.followers:
            parts = await self._update_ranks(samples, adv, token_accept, loss_accept,
                                             denominator, fused, beta)
        else:
            parts = [self.local.update(samples, adv, token_accept, loss_accept, denominator,
                                       fused=fused, entropy_coef=beta)]
        grad_norm = parts[0]["grad_norm"]
        if not math.isfinite(grad_norm):
            raise TrainStepError(f"non-finite gradient norm {grad_norm}; step skipped, weights untouched")
        sums = {k: sum(p[k] for p in parts) for k in UPDATE_SUMS}
        rates: dict[str, list[float]] = {}
        for p in parts:
            for name, values in p["rates"].items():
                rates.setdefault(name, []).extend(values)
        return {"skipped": 0, **groups, **mean_rates(rates), "entropy_coef": beta,
                "loss_forward_seconds": max(p["forward_seconds"] for p in parts),
                "loss_backward_seconds": max(p["backward_seconds"] for p in parts),
                "optimizer_seconds": max(p["optimizer_seconds"] for p in parts),
                "grad_norm": grad_norm,
                "train_rollout_logprob_abs_diff": sums["abs_logprob_diff"] / max(sampled_tokens, 1.0),
                "clipfrac": sums["clipfrac"] / loss_tokens,
                "clipfrac_low": sums["clipfrac_low"] / loss_tokens,
                "clipfrac_high": sums["clipfrac_high"] / loss_tokens, **signal,
                "tis_weight_mean": sums["tis_weight_mean"] / max(sampled_tokens, 1.0),
                # E[-log p(a)] over sampled a is the entropy: an estimate every backend has
                "surprisal_mean": sums["surprisal"] / max(sampled_tokens, 1.0),
                "max_prox_drift": max(p["max_prox_drift"] for p in parts),
                "proximal_cache_peak_bytes": self.cache.peak_bytes,
                "proximal_cache_transferred_bytes": self.cache.transferred_bytes,
                "proximal_cache_pinned": self.cache.pinned}

    async def _update_ranks(self, samples: list[Sample], adv: torch.Tensor,
                            token_accept: dict[int, torch.Tensor],
                            loss_accept: dict[int, torch.Tensor], denominator: float,
                            fused: bool, beta: float) -> list[dict]:
        """:meth:`_update`'s work over the trainer ranks: every data-parallel rank trains its
        equal, contiguous share (the loss scaled by the data-parallel size: the backends
        average gradients over ranks); returns one result per data-parallel rank, rank 0's
        first (its ``grad_norm`` is every rank's: the gradients are the same after the
        reduction). ``beta``: the step's entropy coefficient."""
        shares, dp_ranks, firsts = await self._shares(samples, exact=True)
        dp_size = len(shares)
        starts = np.cumsum([0, *(len(s) for s in shares)])
        d0 = dp_ranks[0]
        prox = {}  # the proximal logprobs each other rank trains with, out of this cache
        for d in set(dp_ranks[1:]) if not fused else ():
            ids = [s.sample_id for s in shares[d]]
            # a model-parallel peer of this rank trains this rank's share: it stays here too
            parts = [self.cache.peek(i) for i in ids] if d == d0 else self.cache.take(ids)
            prox[d] = torch.cat(parts).numpy()
        mask = lambda masks, share: np.concatenate(
            [masks[s.sample_id].numpy() for s in share]) if share else np.zeros(0, bool)
        calls = []
        for i, name in enumerate(self.followers, start=1):
            d = dp_ranks[i]
            calls.append(self._rank(name).train(
                samples_to_columns(shares[d]), adv[starts[d]:starts[d + 1]].numpy(),
                mask(token_accept, shares[d]), mask(loss_accept, shares[d]), denominator,
                fused, prox.get(d), float(dp_size), beta))
        mine, theirs = await self._on_ranks(lambda: self.local.update(
            shares[d0], adv[starts[d0]:starts[d0 + 1]], token_accept, loss_accept, denominator,
            fused=fused, grad_scale=float(dp_size), entropy_coef=beta), calls)
        for i, part in enumerate(theirs, start=1):
            if len(part["entropy"]) and i in firsts:
                self.local.entropies.append(torch.from_numpy(np.array(part["entropy"], np.float32)))
        return [mine, *(part for i, part in enumerate(theirs, start=1)
                        if i in firsts and dp_ranks[i] != d0)]

    # -- checkpoints -------------------------------------------------------------------------
    async def save_checkpoint(self, directory: str) -> str:
        """Write model (HF format), optimizer state, version and RNG state under ``directory``
        (with a backend whose ranks hold parts, every trainer rank writes its own)."""
        out = Path(directory)
        if self.backend.collective_io:
            await self._on_ranks(lambda: self.backend.save_checkpoint(out, self.version),
                                 [self._rank(f).save_checkpoint(str(out), self.version)
                                  for f in self.followers])
        else:  # every rank holds the same weights and optimizer state: rank 0 writes them
            self.backend.save_checkpoint(out, self.version)
        if self.entropy.target:
            (out / ENTROPY_CONTROL_FILE).write_text(strict_json.dumps(self.entropy.state_dict()))
        return str(out)

    async def save_hf(self, directory: str) -> str:
        """Write the current policy as a Hugging Face checkpoint directory (``--save-hf``)."""
        out = Path(directory)
        if self.backend.collective_io:
            await self._on_ranks(lambda: self.backend.save_hf(out),
                                 [self._rank(f).save_hf(str(out)) for f in self.followers])
        else:
            self.backend.save_hf(out)
        return str(out)

    async def load_checkpoint(self, directory: str) -> int:
        """Restore :meth:`save_checkpoint` output on every trainer rank; returns the restored
        trainer version.

        Checked like any other version change: a checkpoint older than the trainer's current
        version is refused (docs/design/version-clock.md#version-clock, rule 1), and loading is atomic
        on each rank (the backend validates every file before it swaps anything in).

        Raises:
            replayrl.actors.version_clock.VersionRegression: the checkpoint's version is below the
                trainer's (nothing was loaded).
            replayrl.rollout.model.CheckpointError / ValueError: a bad checkpoint (nothing was loaded).
            replayrl.actors.RemoteError: another rank refused it.
        """
        path = Path(directory)
        version, theirs = await self._on_ranks(
            lambda: self.backend.load_checkpoint(path, min_version=self.version),
            [self._rank(f).load_checkpoint(str(path), self.version) for f in self.followers])
        if any(v != version for v in theirs):
            raise TrainStepError(f"{directory}: the trainer ranks restored versions "
                                 f"{[version, *theirs]}")
        self.version = version
        saved = path / ENTROPY_CONTROL_FILE  # absent without --entropy-target: fresh state
        if saved.exists():
            self.entropy.load_state_dict(strict_json.loads(saved.read_text()))
        # one update per version: the --indexer-drift-interval phase continues as uninterrupted
        self.local.updates = version
        self._pushed_base = False  # LoRA: the checkpoint's base goes with the next push
        return self.version

    async def state(self) -> dict:
        """Trainer version and parameter count (for the REPL and checks)."""
        return {"version": self.version,
                "parameters": self.backend.parameter_count()}

    async def weights_digest(self) -> dict:
        """Per-tensor raw bytes of weights and optimizer moments (bitwise comparisons in tests)."""
        return self.backend.digest()
