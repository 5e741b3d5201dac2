"""The RolloutManager actor: turns prompt groups into scored trajectories.

For each ``rollout_id`` it draws ``rollout_batch_size`` prompts from the seeded data source and
produces ``n_samples_per_prompt`` trajectories per prompt (groups are split across engines,
whole groups per engine). It drives the turn loop itself (``rollout/episodes/turn_loop.py``): one
``generate`` request to the engine actor per turn, the task's environment between turns when
``max_turns > 1``. Every trajectory, single- or multi-turn, is then assembled by the same
``merge_turns`` call with the run's required traces and scored by the task's reward
(``--rm-type`` by default, ``rollout/tasks/rm_type.py``) or ``--custom-reward`` under one
time limit (``rollout/scoring/rewards.py``). The batch
is kept until the trainer takes it, so the trajectories cross the wire once (engine -> manager
-> trainer), never through the driver. Its data-source state is checkpointable. The prompt
groups of a lost engine are generated again on another one (``rollout/dispatch/engine_pool.py``,
``--engine-failure``).

A multi-turn episode batch holds a version pin on its engine from its first turn to its last
(``replayrl.rollout.dispatch.engine_actor.EngineActor.open_pin``), so a weight push that arrives between
turns loads after it and every trajectory comes from one policy. Should a pin lapse all the
same, the batch's mixed trajectories are never trained: the whole batch (whole prompt groups) is
generated again at the newer version and counted (``episodes_regenerated``;
docs/design/version-clock.md#version-clock).

The task (``--task``, ``rollout/tasks/``) gives the prompts, the reward and the environment;
the manager holds no task code. ``--env`` replaces the task's environment with your own
(``rollout/tasks/environment.py``, the API the task's own is adapted to): one instance per
trajectory, driven through ``rollout/episodes/env_sessions.py``; a trajectory it ends is stored
with status ``aborted`` and counted (``env_failures``, ``env_failure_messages``). Prompts come
from the task (``--prompt-data``, or the built-in task's shipped file) through the run's tokenizer
(``rollout/text/tokenizer.py``, ``rollout/text/prompt_data.py``); ``evaluate`` scores the
``--eval-prompt-data`` sets with the evaluation sampling settings (docs/design/prompt-data.md#prompt-data).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from replayrl.actors import Actor, concurrent, import_callable
from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.dispatch.engine_pool import EnginePool
from replayrl.rollout.dispatch.episode_metrics import episode_metrics
from replayrl.rollout.dispatch.generation_gate import GenerationGate
from replayrl.rollout.dispatch.prefetched import FILE_NAME as PREFETCHED_FILE
from replayrl.rollout.dispatch.prefetched import read_prefetched, write_prefetched
from replayrl.rollout.engines.base import generations_from_columns
from replayrl.rollout.episodes.env_sessions import EnvSessions
from replayrl.rollout.episodes.single_turns import single_turn_columns
from replayrl.rollout.episodes.turn_loop import Episode, assemble, run_episodes
from replayrl.rollout.errors import RolloutError, SampleError, TrajectoryError
from replayrl.rollout.sample import Sample, check_contract, samples_from_columns, samples_to_columns, unpack_rows
from replayrl.rollout.scoring.evaluation import eval_metrics
from replayrl.rollout.scoring.rewards import RewardGuard, load_math_verify
from replayrl.rollout.tasks import load_environment_class, make_task
from replayrl.rollout.text.data_source import Prompt, PromptDataSource
from replayrl.rollout.text.prompt_data import load_run_prompts
from replayrl.rollout.text.tokenizer import load_tokenizer
from replayrl.rollout.traces.trajectory import append_synthetic_eos

log = logging.getLogger(__name__)

MIXED_VERSION_RERUNS = 2
"""How many times a multi-turn episode batch whose turns still came from two weight versions
(a lapsed version pin) is generated again before the trajectory's ``MixedVersionError`` ends
the rollout."""


def _status(finish_reason: str) -> str:
    """A trajectory's status from its episode's finish reason: ``"completed"`` when the engine
    stopped it (``"stop"``), ``"aborted"`` when an ``--env`` environment ended it
    (``"env_error"``), else ``"truncated"`` (length, turn or position limit)."""
    return ("completed" if finish_reason == "stop"
            else "aborted" if finish_reason == "env_error" else "truncated")


def observation_segments(loss_mask: np.ndarray) -> int:
    """Number of maximal runs of observation tokens (loss mask 0): one per tool call answered."""
    obs = np.asarray(loss_mask) == 0
    return int(obs[0]) + int(np.count_nonzero(obs[1:] & ~obs[:-1])) if len(obs) else 0


class RolloutManager(Actor):
    """Actor that produces and stores rollout batches.

    Args:
        config: :meth:`RolloutConfig.to_dict` output.
        engines: names of the engine actors in the run's directory.
        require_traces: the run's required traces (``replayrl.rollout.sample.required_traces``, the
            same list the engines capture); a trajectory without one is an error at assembly,
            never trained silently.
        max_positions: the policy's ``max_position_embeddings``; a multi-turn trajectory whose
            next turn would not fit ends there (``"length"``).
        tokenizer_dir: the checkpoint directory whose tokenizer encodes the prompts
            (``--tokenizer``, by default the run's initial checkpoint).
        vocab_size: the policy's vocabulary size (prompt ids must lie below it).
        engine_failure: ``--engine-failure`` (:data:`replayrl.rollout.dispatch.engine_pool.ENGINE_FAILURE_POLICIES`):
            what a lost engine's unfinished prompt groups get (docs/design/engine-faults.md#engine-faults).
        task: the ``"module:Class"`` of the run's task (the launcher resolves ``--task`` in its
            own process: ``replayrl.rollout.tasks.task_class_path``); ``""`` = the one the
            config selects (``replayrl.rollout.tasks.make_task``).
        tokenizer_class: the class that reads the tokenizer, resolved by the launcher's
            initial-files child (``replayrl.rollout.text.tokenizer_class``): loads without torch;
            None: ``AutoTokenizer`` (imports torch).

    Raises:
        RolloutError: no engine, ``--custom-reward`` not importable, or
            ``--rollout-max-turns > 1`` with a task that has no environment.
        replayrl.rollout.errors.TaskConfigError: the task is unknown or refuses the settings.
        replayrl.rollout.text.tokenizer.TokenizerError,
        replayrl.rollout.text.prompt_data.PromptDataError: the tokenizer or a prompt row is
            unusable (the launcher checks both before any process starts).
        replayrl.rollout.scoring.rewards.RewardError: ``--rm-type math`` without the math-verify package.
    """

    def __init__(self, config: dict, engines: list[str], require_traces: list[str],
                 max_positions: int, tokenizer_dir: str, vocab_size: int,
                 engine_failure: str = "fail", task: str = "",
                 tokenizer_class: str | None = None) -> None:
        self.config = RolloutConfig(**config)
        if not engines:
            raise RolloutError("RolloutManager needs at least one engine")
        self.engines = list(engines)
        # a lost engine's unfinished groups are regenerated (or the run ends) per --engine-failure
        self.pool = EnginePool(self.engines, engine_failure, self.config.generate_timeout_s)
        self.max_positions = int(max_positions)
        self.task = make_task(self.config, task)
        # The environment answers tool calls only when the run allows more than one turn; one
        # reward scores every trajectory, single- or multi-turn (the task's, on its final turn).
        # --env (your own environment, rollout/tasks/environment.py) replaces the task's; either
        # way the turn loop's sessions (rollout/episodes/env_sessions.py) drive one instance per
        # trajectory (the task's own behind an ObserveAdapter)
        self.env_class = load_environment_class(self.config.env) if self.config.env else None
        self.env = (self.task.environment()
                    if self.config.max_turns > 1 and self.env_class is None else None)
        if self.config.max_turns > 1 and self.env is None and self.env_class is None:
            raise RolloutError(f"--rollout-max-turns {self.config.max_turns}: the task "
                               f"{type(self.task).__name__} has no multi-turn environment")
        # the launcher already refused an unimportable --custom-reward before any process started
        self.custom_reward = (import_callable(self.config.custom_reward, "--custom-reward")
                              if self.config.custom_reward else None)
        self.require_traces = tuple(require_traces)
        cfg = self.config
        self.tokenizer = load_tokenizer(tokenizer_dir, apply_chat_template=cfg.apply_chat_template,
                                        chat_template_kwargs=json.loads(cfg.apply_chat_template_kwargs),
                                        tools=self.env_class.tools if self.env_class else (),
                                        tokenizer_class=tokenizer_class)
        if cfg.rm_type == "math" and not cfg.custom_reward:
            load_math_verify()  # a missing extra fails at start, not at the first reward
        self.reward_guard = RewardGuard(cfg.reward_timeout_s, cfg.reward_failure)
        prompts = load_run_prompts(cfg, self.tokenizer, vocab_size=vocab_size,
                                   max_positions=self.max_positions, task=self.task)
        self.data = PromptDataSource(prompts.train, cfg.seed, cfg.num_epoch, prompts.name)
        # Replacement prompts have their own seeded stream (the built-in task: its own dataset)
        self.replacement_data = PromptDataSource(prompts.replacement, cfg.seed + 7919, 0,
                                                 prompts.name)
        self.eval_sets = prompts.evals
        self.replacement_calls = 0
        self.data_state_before: dict[int, dict] = {}
        self.batches: dict[int, list[Sample]] = {}
        # each stored batch already as take_batch sends it: encoded while the trainer still
        # trains on the step before, not on its path when it asks
        self.batch_columns: dict[int, dict] = {}
        self.summaries: dict[int, dict] = {}  # generate's result of each stored batch
        self.restored: set[int] = set()  # stored batches a checkpoint gave back (load_state)
        self.next_sample_id = 0
        self.next_group_id = 0
        self.gate = GenerationGate()  # pause_generation / resume_generation
        self.latest_sample: Sample | None = None  # for consoles: last_sample()
        self._pin_ids = itertools.count()  # version pins of multi-turn episode batches
        self._releases: set[asyncio.Future] = set()  # pin releases sent after a failure

    async def _episodes(self, engine: str, prompts: list[np.ndarray], seed: int, sampling: dict,
                        max_new_tokens: int, min_version: int | None,
                        records: list[Prompt] | None = None) -> tuple[list[Episode], int]:
        """The turn loop of ``prompts`` on one engine actor (one ``generate`` request per turn,
        each served at ``min_version`` or later), and the number of episodes generated again
        because their turns came from two weight versions.

        Multi-turn batches hold a version pin for their duration (:meth:`_pinned_episodes`);
        a batch that still saw two versions (its pin lapsed) is generated again, whole and
        with the same seed, at the newest version it saw, up to :data:`MIXED_VERSION_RERUNS`
        times; the last attempt's episodes are returned as they are (assembly then raises
        ``MixedVersionError``). Single-turn batches are one call, unpinned, as always.
        ``records``: the :class:`Prompt` of each of ``prompts`` (what an ``--env``
        environment's ``reset`` gets).
        """
        if self.config.max_turns == 1:
            return await self._pinned_episodes(engine, prompts, seed, sampling, max_new_tokens,
                                               min_version, pin=False, records=records), 0
        regenerated = 0
        for attempt in range(MIXED_VERSION_RERUNS + 1):
            episodes = await self._pinned_episodes(engine, prompts, seed, sampling,
                                                   max_new_tokens, min_version, pin=True,
                                                   records=records)
            mixed = [e.versions for e in episodes if len(set(e.versions)) > 1]
            if not mixed or attempt == MIXED_VERSION_RERUNS:
                return episodes, regenerated
            regenerated += len(episodes)
            min_version = max(v for versions in mixed for v in versions)
            log.warning("%d of %d episodes on %s crossed a weight push (turn versions %s); "
                        "generating the batch again at version %d", len(mixed), len(episodes),
                        engine, mixed[0], min_version)
        raise AssertionError("unreachable")

    async def _pinned_episodes(self, engine: str, prompts: list[np.ndarray], seed: int,
                               sampling: dict, max_new_tokens: int, min_version: int | None,
                               pin: bool, records: list[Prompt] | None = None) -> list[Episode]:
        """One run of the turn loop of ``prompts`` on ``engine``; with ``pin``, under a version
        pin opened (at ``min_version`` or later) before the first turn and released after the
        last (on failure: released without waiting, or left to lapse)."""
        cfg = self.config
        actor = self.proxy(engine, timeout=cfg.generate_timeout_s)
        pin_id = f"{self.name or 'rollout_manager'}:{next(self._pin_ids)}" if pin else None
        if pin_id is not None:
            await actor.open_pin(pin_id, min_version)

        async def generate_turn(contexts: list[list[int]], turn_seed: int):
            async with self.gate.request():  # held here while generation is paused
                if pin_id is None:
                    reply = await actor.generate([np.asarray(c, dtype=np.int32) for c in contexts],
                                                 sampling, max_new_tokens=max_new_tokens,
                                                 eos_token_id=self.tokenizer.eos_token_id,
                                                 seed=turn_seed, min_version=min_version)
                else:  # the pin's version is at min_version or later already
                    reply = await actor.generate([np.asarray(c, dtype=np.int32) for c in contexts],
                                                 sampling, max_new_tokens=max_new_tokens,
                                                 eos_token_id=self.tokenizer.eos_token_id,
                                                 seed=turn_seed, pin=pin_id)
            return generations_from_columns(reply["generations"]), reply["version"]

        env = None  # fresh sessions for this batch, one environment instance per trajectory
        if self.env_class is not None:
            env = EnvSessions(lambda: self.env_class(cfg), records, tokenizer=self.tokenizer,
                              timeout_s=cfg.env_timeout_s, failure=cfg.env_failure, name=cfg.env)
        elif self.env is not None:
            env = EnvSessions.of_task(self.env, records, tokenizer=self.tokenizer)
        try:
            episodes = await run_episodes(generate_turn, prompts, max_turns=cfg.max_turns,
                                          max_new_tokens=max_new_tokens,
                                          max_positions=self.max_positions, seed=seed,
                                          env=env)
        except BaseException:
            if pin_id is not None:  # the engine may be lost: do not wait for it here
                release = asyncio.ensure_future(actor.release_pin(pin_id))
                self._releases.add(release)
                release.add_done_callback(lambda f: (self._releases.discard(f),
                                                     f.cancelled() or f.exception()))
            raise
        if pin_id is not None:
            await actor.release_pin(pin_id)
        return episodes

    async def _run_prompts(self, prompts: list[Prompt], n: int, seed_key: list[int],
                           sampling: dict, max_new_tokens: int,
                           min_version: int | None) -> tuple[list[list[Episode]], int, int]:
        """``n`` episodes per prompt (``[len(prompts)][n]``), whole prompts split over engines,
        served at policy ``min_version`` or later, the number of prompt groups that were
        generated again because their engine was lost (:class:`replayrl.rollout.dispatch.engine_pool.EnginePool`),
        and the number of episodes generated again because their turns crossed a weight push
        (:meth:`_episodes`).

        The split, and each chunk's seed, depend on the run's engine count only, never on
        which engines are alive: a chunk regenerated on another engine is the same request,
        so (at the same weights) it gives the same trajectories the lost engine would have.
        """
        chunks = [list(range(i, len(prompts), len(self.engines))) for i in range(len(self.engines))]
        seeds = np.random.SeedSequence([self.config.seed, *seed_key]).generate_state(len(self.engines))

        def chunk_work(chunk: list[int], seed: int):
            return lambda engine: self._episodes(
                engine, [prompts[g].prompt_ids for g in chunk for _ in range(n)], seed, sampling,
                max_new_tokens, min_version, [prompts[g] for g in chunk for _ in range(n)])

        replies = await asyncio.gather(*(
            self.pool.run(engine, chunk_work(chunk, int(seed)))
            for engine, chunk, seed in zip(self.engines, chunks, seeds) if chunk))
        out: list[list[Episode]] = [[] for _ in prompts]
        regenerated = mixed = 0
        for chunk, ((episodes, again), reruns) in zip([c for c in chunks if c], replies):
            regenerated += reruns * len(chunk)
            mixed += again
            episode = iter(episodes)
            for g in chunk:
                out[g] = [next(episode) for _ in range(n)]
        return out, regenerated, mixed

    async def _generate_groups(self, prompts: list[Prompt], rollout_id: int,
                               seed_key: list[int], min_version: int | None
                               ) -> tuple[list[Sample], int, int, list[str], dict]:
        """Generate ``n_samples_per_prompt`` trajectories per prompt, assemble and score them;
        returns them, the number of groups regenerated after an engine loss, the number of
        episodes regenerated because they crossed a weight push, the failure message of
        each trajectory an ``--env`` environment ended (status ``aborted``) and, with
        ``--rollout-max-turns > 1``, the per-episode figures
        (:func:`replayrl.rollout.dispatch.episode_metrics.episode_metrics`; else ``{}``)."""
        cfg = self.config
        group_ids = list(range(self.next_group_id, self.next_group_id + len(prompts)))
        self.next_group_id += len(prompts)
        episodes, regenerated, mixed = await self._run_prompts(
            prompts, cfg.n_samples_per_prompt, seed_key, cfg.sampling_dict(),
            cfg.max_response_len, min_version)
        # sample ids in the order the engines' chunks come back, as before (engine 0's groups
        # first): a resumed or repeated run numbers its samples the same way
        order = [g for i in range(len(self.engines)) for g in range(i, len(prompts), len(self.engines))]
        ordered = [(g, e) for g in order for e in episodes[g]]
        columns = self._single_turn_columns([e for _, e in ordered])
        if columns is None:
            samples, verified = await self._assemble_each(ordered, prompts, group_ids, rollout_id)
        else:
            samples, verified = await self._assemble_columns(columns, ordered, prompts, group_ids,
                                                             rollout_id)
        failures = [e.failure for _, e in ordered if e.failure]
        for message in failures:
            log.warning("%s; the trajectory ends there (status aborted)", message)
        per_episode = (episode_metrics([e for _, e in ordered], verified,
                                       env=self.env_class is not None)
                       if cfg.max_turns > 1 and ordered else {})
        samples.sort(key=lambda s: (s.group_id, s.sample_id))  # groups contiguous for GRPO
        if samples:
            self.latest_sample = samples[-1]
        return samples, regenerated, mixed, failures, per_episode

    def _single_turn_columns(self, episodes: list[Episode]) -> dict | None:
        """The batch as checked columns (:func:`replayrl.rollout.episodes.single_turns.single_turn_columns`),
        or ``None`` where each episode must be assembled on its own: a multi-turn or unusual
        batch, a trajectory that gets a synthetic EOS, or a failed check, the sample contract's
        included (:meth:`_assemble_each` then raises the error, in the order it always has:
        the first bad trajectory's, before any later trajectory is scored)."""
        columns = single_turn_columns(episodes, self.require_traces)
        if columns is None:
            return None
        if self.config.append_eos_on_truncation:
            last = columns["response_ids"][np.cumsum(columns["response_lengths"]) - 1]
            capped = np.array([e.finish_reason == "length" for e in episodes])
            if (capped & (last != self.tokenizer.eos_token_id)).any():
                return None
        n = len(episodes)
        try:  # the contract before any reward runs: a break is reported as Sample reports it
            check_contract(list(range(self.next_sample_id, self.next_sample_id + n)),
                           columns["prompt_lengths"], columns["response_lengths"],
                           columns["loss_mask"], columns["rollout_logprobs"],
                           [_status(e.finish_reason) for e in episodes], [0.0] * n,
                           np.zeros(n, dtype=bool), columns["sample_support"])
        except SampleError:
            return None
        return columns

    async def _assemble_each(self, ordered: list[tuple[int, Episode]], prompts: list[Prompt],
                             group_ids: list[int], rollout_id: int
                             ) -> tuple[list[Sample], list[float | None]]:
        """Assemble (:meth:`_assemble`), score and build each trajectory on its own; returns
        the samples in ``ordered``'s order and each one's verifier reward (``None`` where no
        verifier scores). Raises what :meth:`_assemble`, :meth:`_episode_reward` and
        :class:`replayrl.rollout.sample.Sample` raise, for the first bad trajectory."""
        unscored = [(self._assemble(e, prompts[g], group_ids[g], rollout_id), prompts[g], e)
                    for g, e in ordered]
        # each Sample is built (and its contract checked) once, with its reward
        samples, verified = [], []
        for kw, p, e in unscored:
            reward, checked = await self._episode_reward(kw, p, e)
            samples.append(Sample(**kw, reward=reward))
            verified.append(checked)
        return samples, verified

    async def _assemble_columns(self, columns: dict, ordered: list[tuple[int, Episode]],
                                prompts: list[Prompt], group_ids: list[int], rollout_id: int
                                ) -> tuple[list[Sample], list[float | None]]:
        """:meth:`_assemble_each` for a batch :meth:`_single_turn_columns` took whole: the same
        samples (ids, arrays, rewards) from its columns, scored one by one and built with one
        contract check for the batch (:func:`replayrl.rollout.sample.samples_from_columns`).

        Raises:
            replayrl.rollout.errors.SampleError: a non-finite reward (an ``--env`` environment's),
                named as the sample's own construction names it, before the next is scored (the
                rest of the contract was checked by :meth:`_single_turn_columns`).
            replayrl.rollout.scoring.rewards.RewardFailure: as :meth:`_reward`.
        """
        n = len(ordered)
        sample_ids = list(range(self.next_sample_id, self.next_sample_id + n))
        self.next_sample_id += n
        P, R = columns["prompt_lengths"], columns["response_lengths"]
        prompt_rows = unpack_rows(columns["prompt_ids"], P)
        response_rows = unpack_rows(columns["response_ids"], R)
        mask_rows = unpack_rows(columns["loss_mask"], R)
        rewards, verified = [], []
        for i, (g, e) in enumerate(ordered):
            fields = {"sample_id": sample_ids[i], "prompt_ids": prompt_rows[i],
                      "response_ids": response_rows[i], "loss_mask": mask_rows[i]}
            reward, checked = await self._episode_reward(fields, prompts[g], e)
            if not math.isfinite(reward):  # named now, as Sample would, before the next is scored
                check_contract([sample_ids[i]], P[i:i + 1], R[i:i + 1], mask_rows[i],
                               np.zeros(len(mask_rows[i]), np.float32), [_status(e.finish_reason)],
                               [reward], np.zeros(1, dtype=bool), None)
            rewards.append(reward)
            verified.append(checked)
        samples = samples_from_columns({
            **columns, "sample_id": np.array(sample_ids, dtype=np.int64),
            "group_id": np.array([group_ids[g] for g, _ in ordered], dtype=np.int64),
            "rollout_id": np.full(n, rollout_id, dtype=np.int64),
            "reward": np.array(rewards, dtype=np.float64), "synthetic_eos": np.zeros(n, dtype=bool),
            "status": [_status(e.finish_reason) for _, e in ordered]})
        return samples, verified

    async def _episode_reward(self, fields: dict, prompt: Prompt,
                              episode: Episode) -> tuple[float, float | None]:
        """A trajectory's reward: the verifier's (:meth:`_reward`), or with ``--env``, as
        ``--env-reward`` says: the verifier's, the environment's step rewards summed
        (``episode.env_reward``), or both added; and the verifier's reward alone (``None``
        where no verifier scores: ``--env-reward env``)."""
        source = self.config.env_reward if self.env_class is not None else "verifier"
        if source == "env":
            return float(episode.env_reward), None
        verified = await self._reward(fields["sample_id"], prompt, fields["response_ids"],
                                      fields["loss_mask"], fields["prompt_ids"])
        return (verified + float(episode.env_reward) if source == "sum" else verified), verified

    async def _reward(self, sample_id: int | str, prompt: Prompt, response_ids: np.ndarray,
                      loss_mask: np.ndarray, prompt_ids: np.ndarray | None = None) -> float:
        """The reward of one trajectory (``--custom-reward``, else the task's: ``--rm-type`` by
        default), under the reward guard's time limit. ``prompt_ids``: the trajectory's prompt
        ids as trained (an ``--env`` opening observation included; default ``prompt.prompt_ids``),
        which ``--custom-reward`` gets.

        Raises:
            replayrl.rollout.scoring.rewards.RewardFailure: the reward raised or ran over the limit, under
                ``--reward-failure error`` (names the sample and the prompt's row).
        """
        cfg = self.config
        name = f"sample {sample_id} (prompt {prompt.source or prompt.index})"
        if self.custom_reward is not None:
            return await self.reward_guard.score(name, self.custom_reward,
                                                 prompt.prompt_ids if prompt_ids is None else prompt_ids,
                                                 response_ids, loss_mask, prompt.answer_id, cfg)
        # a bounded reward (digits / exact) runs inline; a custom reward and math-verify can
        # run long and get a thread and the time limit
        return await self.reward_guard.run(name, self.task.reward(self.tokenizer, prompt,
                                                                   response_ids, loss_mask))

    @concurrent
    async def generate(self, rollout_id: int, min_version: int | None = None) -> dict:
        """Generate, score and store one batch; returns its summary (floats, seconds).

        ``min_version``: the policy version the engines must serve it at, or later (they wait
        for a weight push still on its way; ``replayrl.rollout.dispatch.engine_actor.EngineActor.generate``).

        The summary's ``engines_alive`` and ``groups_regenerated`` give the capacity: engines
        in the pool when the batch was complete, and the prompt groups generated again because
        their engine was lost (docs/design/engine-faults.md#engine-faults). With ``--rollout-max-turns > 1`` it
        also has ``tool_calls_mean`` and ``episodes_regenerated`` (trajectories generated again,
        whole batches, because a weight push landed between their turns after their version pin
        lapsed; docs/design/version-clock.md#version-clock).

        A rollout that :meth:`load_state` restored from a checkpoint is not generated: its
        stored summary is returned, once, and its batch is trained as the interrupted run would
        have trained it.

        Raises:
            RolloutError: a batch with this id is already stored.
            replayrl.actors.RemoteError / ActorTimeout: an engine failed or did not answer in time.
            replayrl.rollout.dispatch.engine_pool.EnginesLost: no engine left (``--engine-failure regenerate``)
                or none restored in time (``restart``); replayrl.actors.errors.PeerLost: an engine
                lost under ``fail``.
        """
        if rollout_id in self.restored:  # a checkpoint's prefetched batch: trained as it was
            self.restored.discard(rollout_id)
            return dict(self.summaries[rollout_id])
        if rollout_id in self.batches:
            raise RolloutError(f"rollout {rollout_id} already generated and not yet taken")
        start = time.perf_counter()
        # The data state before this draw: a checkpoint taken before this rollout is trained
        # stores the batch itself (state), and records this too, for a resume that cannot
        # train it (a synchronous one) and draws the same prompts again
        self.data_state_before[rollout_id] = self.data.state_dict()
        prompts = self.data.next_batch(self.config.rollout_batch_size)  # before any await
        samples, regenerated, mixed, env_failures, per_episode = await self._generate_groups(
            prompts, rollout_id, [rollout_id], min_version)
        self.batch_columns[rollout_id] = samples_to_columns(samples)
        self.batches[rollout_id] = samples
        rewards = np.array([s.reward for s in samples])
        summary = {"rollout_id": rollout_id, "samples": len(samples),
                   "reward_mean": float(rewards.mean()), "reward_max": float(rewards.max()),
                   "response_len_mean": float(np.mean([len(s.response_ids) for s in samples])),
                   "truncated_fraction": float(np.mean([s.status == "truncated" for s in samples])),
                   "policy_versions": sorted({s.policy_version for s in samples}),
                   "prompt_indices": [p.index for p in prompts],
                   "generate_seconds": time.perf_counter() - start,
                   # capacity: engines serving when the batch was complete, and the groups
                   # that had to be generated again because their engine was lost
                   "engines_alive": len(self.pool.live()),
                   "groups_regenerated": regenerated}
        if self.config.append_eos_on_truncation:
            summary["synthetic_eos_fraction"] = float(np.mean([s.synthetic_eos for s in samples]))
        if self.config.max_turns > 1:
            summary["tool_calls_mean"] = float(np.mean([observation_segments(s.loss_mask)
                                                        for s in samples]))
            # trajectories generated again because a weight push landed between their turns
            # and their version pin had lapsed (docs/design/version-clock.md#version-clock)
            summary["episodes_regenerated"] = mixed
            # turns, unreadable tool calls, final-answer accuracy (episode_metrics)
            summary.update(per_episode)
        if self.env_class is not None:
            # trajectories an --env environment ended (status aborted), each message naming
            # the environment, the prompt and the turn (docs/own-data.md)
            summary["env_failures"] = len(env_failures)
            summary["env_failure_messages"] = env_failures
        if self.config.reward_failure == "zero":
            summary["reward_failures"] = self.reward_guard.failures  # run total so far
        self.summaries[rollout_id] = summary  # a checkpoint taken before it is trained keeps it
        return summary

    @concurrent
    async def evaluate(self, step: int, min_version: int | None = None) -> dict:
        """Score every ``--eval-prompt-data`` set at the engines' current weights (at policy
        ``min_version`` or later, as :meth:`generate`).

        Each prompt gets ``n_samples_per_eval_prompt`` samples with the evaluation sampling
        settings; nothing is stored or trained and the training data's position is untouched.

        With ``--rollout-max-turns > 1`` the episodes are multi-turn as in training (an
        ``--env`` environment answers the tool calls), and each set also reports
        ``eval/NAME/turns_mean``, ``eval/NAME/tool_calls_mean`` and, with ``--env``,
        ``eval/NAME/parse_errors_mean`` (per episode, as the training summary's).

        Returns:
            :func:`replayrl.rollout.scoring.evaluation.eval_metrics` of each set (``eval/NAME/reward_mean``,
            ``eval/NAME/pass@k`` ...), the per-episode figures above, plus ``eval_seconds``.
        Raises:
            replayrl.rollout.scoring.rewards.RewardFailure, replayrl.actors.RemoteError: as :meth:`generate`.
        """
        cfg = self.config
        start = time.perf_counter()
        n = cfg.n_samples_per_eval_prompt
        out: dict = {}
        for k, (name, prompts) in enumerate(self.eval_sets):
            episodes, _, _ = await self._run_prompts(
                prompts, n, [1 << 21, int(step), k], cfg.eval_sampling_dict(),
                cfg.eval_max_response_len or cfg.max_response_len, min_version)
            rewards, calls = [], []
            for g, prompt in enumerate(prompts):
                row = []
                for i, episode in enumerate(episodes[g]):
                    label = f"eval {name} #{g * n + i}"
                    merged, _ = assemble(episode, sample_id=label, require=())
                    f = merged.sample_fields()
                    row.append(await self._reward(label, prompt, f["response_ids"], f["loss_mask"]))
                    calls.append(observation_segments(f["loss_mask"]))
                rewards.append(row)
            out.update(eval_metrics(name, np.asarray(rewards, dtype=np.float64)))
            if cfg.max_turns > 1:  # did the agent use its tool on prompts it never trained on
                flat = [e for row in episodes for e in row]
                figures = episode_metrics(flat, [None] * len(flat), env=self.env_class is not None)
                figures["tool_calls_mean"] = float(np.mean(calls))
                out.update({f"eval/{name}/{k}": v for k, v in figures.items()})
        out["eval_seconds"] = time.perf_counter() - start
        return out

    @concurrent
    async def generate_replacements(self, n_groups: int, min_version: int | None = None) -> dict:
        """Exact refill: ``n_groups`` fresh prompt groups from the current policy, as columns
        (``replayrl.rollout.sample.samples_to_columns``).

        ``min_version``: as :meth:`generate` (the trainer passes its preflight version).
        Replacement prompts come from their own seeded stream, so refill never shifts the prompts
        of later rollouts (a resumed run sees the same batches). Samples carry the version of the
        engine that generated them; the trainer has the VersionClock check it.
        """
        if n_groups < 1:
            raise RolloutError(f"generate_replacements needs n_groups >= 1, got {n_groups}")
        self.replacement_calls += 1
        prompts = self.replacement_data.next_batch(n_groups)
        samples, _, _, _, _ = await self._generate_groups(prompts, -1,
                                                       [1 << 20, self.replacement_calls],
                                                       min_version)
        return samples_to_columns(samples)

    def _assemble(self, episode: Episode, prompt: Prompt, group_id: int, rollout_id: int) -> dict:
        """Assemble one trajectory (``merge_turns``, required traces, one policy version): the
        keyword arguments of its :class:`replayrl.rollout.sample.Sample` but the reward, which
        :meth:`_reward` gives. The arrays are read-only already (a verifier cannot change
        them, and the Sample takes them without another copy).

        With ``--rollout-append-eos-on-truncation``, a trajectory that hit its length cap
        (``finish_reason == "length"``, status ``truncated``) and does not already end with a
        sampled EOS gets a synthetic EOS (``replayrl.rollout.traces.trajectory.append_synthetic_eos``) before it
        is scored. The reward is then the verifier's (the task's, or ``--custom-reward``'s)
        for the response as it will be trained, EOS included: reward, tokens and advantage
        describe one sequence, and a custom verifier sees exactly the
        arrays the trainer trains on. (SkyRL instead scores the text without its appended EOS
        and places that reward on the EOS.) On the digit task a capped response keeps its
        reward unless the EOS lands right after the first digit (``--rollout-max-response-len
        1``), where the task's definition gives it the full "stopped" reward. The status stays
        ``truncated``: the engine did not stop by itself.

        Raises:
            replayrl.rollout.errors.MixedVersionError: turns from different weight versions.
            replayrl.rollout.errors.MissingTraceError: a required trace missing.
            replayrl.rollout.errors.TrajectoryError: a trace misaligned; with the
                synthetic EOS, a trajectory whose ``P + R + 1`` tokens would not fit the model's
                ``max_position_embeddings`` (field ``synthetic_eos``).
        """
        sample_id = self.next_sample_id
        self.next_sample_id += 1
        merged, version = assemble(episode, sample_id=sample_id, require=self.require_traces)
        fields = merged.sample_fields()
        prompt_ids = prompt.prompt_ids
        if episode.prompt_ids != tuple(int(t) for t in prompt_ids):  # an --env opening observation
            prompt_ids = np.asarray(episode.prompt_ids, dtype=np.int32)
            prompt_ids.flags.writeable = False
        status = _status(episode.finish_reason)
        eos = self.tokenizer.eos_token_id
        if (self.config.append_eos_on_truncation and episode.finish_reason == "length"
                and int(fields["response_ids"][-1]) != eos):
            if len(prompt_ids) + len(fields["response_ids"]) + 1 > self.max_positions:
                raise TrajectoryError(sample_id, "synthetic_eos",
                                      f"P + R + 1 = {len(prompt_ids) + len(fields['response_ids']) + 1} "
                                      f"tokens exceed max_position_embeddings {self.max_positions}; "
                                      "--rollout-append-eos-on-truncation needs one more position")
            capped = Sample(sample_id=sample_id, group_id=group_id, rollout_id=rollout_id,
                            policy_version=version, prompt_ids=prompt_ids, status=status,
                            **fields)
            appended = append_synthetic_eos(capped, eos)
            fields = {name: getattr(appended, name) for name in (*fields, "synthetic_eos")}
        for value in fields.values():
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
        return dict(sample_id=sample_id, group_id=group_id, rollout_id=rollout_id,
                    policy_version=version, prompt_ids=prompt_ids, status=status, **fields)

    @concurrent  # waits for the engines; must not hold up take_batch behind it
    async def pause_generation(self, wait: bool = True) -> dict:
        """Pause generation: engine requests not yet sent wait until :meth:`resume_generation`;
        those already at an engine finish (docs/design/multi-host.md#attach-and-multi-host).

        Weight versions are untouched: a held request is later served at whatever version the
        engine then has, and the loop pushes no weights while a rollout it waits for is held, so
        the samples' versions and the clock's window are those of a run never paused. A trainer
        whose exact-refill call waits at the gate longer than ``--rs-refill-rpc-timeout-seconds`` fails
        its step, as for a slow engine.

        Args:
            wait: return only once no engine request is in flight (the engines are idle).
        Returns:
            ``{"paused": True, "in_flight": int, "held": int}``
            (:meth:`replayrl.rollout.dispatch.generation_gate.GenerationGate.state`).
        """
        self.gate.pause()
        if wait:
            await self.gate.drained()
        return self.gate.state()

    @concurrent
    async def resume_generation(self) -> dict:
        """Let held engine requests go on; returns the gate's state as :meth:`pause_generation`."""
        self.gate.resume()
        return self.gate.state()

    @concurrent
    async def generation_status(self) -> dict:
        """The gate's state without changing it, as :meth:`pause_generation` returns it."""
        return self.gate.state()

    async def last_sample(self) -> dict:
        """The most recently scored trajectory (training or refill), as one-row columns
        (``replayrl.rollout.sample.samples_to_columns``: ids, loss mask, logprobs, reward and every
        captured trace as a plain array, e.g. ``routed_experts`` int32
        ``[P + R - 1, layers, top_k]``, not the compact wire form); ``{}`` before the first
        rollout. Read-only: nothing is taken from a stored batch."""
        if self.latest_sample is None:
            return {}
        return samples_to_columns([self.latest_sample], compact=False)

    @concurrent
    async def restore_engine(self, engine: str) -> list[str]:
        """Put a restarted engine back into the pool once it serves the current weights
        (``--engine-failure restart``; the launcher calls this); returns the live engines.

        Raises:
            ValueError: ``engine`` is not one of the run's engines.
            replayrl.actors.ActorTimeout: this process cannot reach it within
                ``--rollout-timeout-seconds``.
        """
        if engine not in self.engines:
            raise ValueError(f"unknown engine {engine!r}; the run's engines: {self.engines}")
        # this process's connection to the new process must be back before work is sent to it
        await self.ref(engine).reachable(self.config.generate_timeout_s)
        self.pool.restore(engine)
        return self.pool.live()

    async def take_batch(self, rollout_id: int) -> dict:
        """Hand over (and forget) a stored batch as columns (``replayrl.rollout.sample.samples_to_columns``),
        groups contiguous.

        Raises:
            RolloutError: no batch with this id is stored.
        """
        self.data_state_before.pop(rollout_id - 1, None)  # older snapshots are never needed
        self.summaries.pop(rollout_id, None)
        try:
            samples = self.batches.pop(rollout_id)
        except KeyError:
            raise RolloutError(f"rollout {rollout_id} is not stored; have {sorted(self.batches)}") from None
        columns = self.batch_columns.pop(rollout_id, None)  # none for a checkpoint's batch
        return samples_to_columns(samples) if columns is None else columns

    async def state(self, next_rollout_id: int | None = None, directory: str | None = None) -> dict:
        """Checkpointable state.

        Args:
            next_rollout_id: the first rollout the resumed run will train.
            directory: the checkpoint directory being written. When rollout ``next_rollout_id``
                is already generated and stored (the asynchronous loop's prefetch), it is
                written there (``replayrl.rollout.dispatch.prefetched``) and the state records
                it, with the data state after its draw: the resumed run trains that very batch.
                Without ``directory`` (or with no such batch) the data state is the one before
                that rollout's draw, so a resumed run draws the same prompts again.
        Returns:
            JSON-like: ``data``, ``replacement_data`` (cursors), ``replacement_calls``,
            ``next_sample_id``, ``next_group_id`` and, when the batch was written,
            ``prefetched``: ``{"rollout_id", "file", "data_before"}`` (the file's name in
            ``directory``, the data state before that rollout's draw).
        """
        data = self.data.state_dict()
        prefetched = None
        if (directory is not None and next_rollout_id in self.batches
                and next_rollout_id in self.summaries):
            write_prefetched(Path(directory) / PREFETCHED_FILE, next_rollout_id,
                             self.summaries[next_rollout_id], self.batches[next_rollout_id])
            prefetched = {"rollout_id": next_rollout_id, "file": PREFETCHED_FILE,
                          "data_before": self.data_state_before[next_rollout_id]}
            if next_rollout_id + 1 in self.data_state_before:  # a later rollout was drawn since
                data = self.data_state_before[next_rollout_id + 1]
        elif next_rollout_id is not None and next_rollout_id in self.data_state_before:
            data = self.data_state_before[next_rollout_id]
        return {"data": data, "replacement_data": self.replacement_data.state_dict(),
                "replacement_calls": self.replacement_calls,
                "next_sample_id": self.next_sample_id, "next_group_id": self.next_group_id,
                **({"prefetched": prefetched} if prefetched else {})}

    async def load_state(self, state: dict, directory: str | None = None,
                         prefetched: bool = True) -> None:
        """Restore :meth:`state` output (drops stored, untrained batches).

        Args:
            directory: the checkpoint directory (where a ``prefetched`` batch's file is).
            prefetched: restore a checkpoint's prefetched batch, so that the next
                :meth:`generate` of its rollout returns it without generating. ``False`` (a
                synchronous run resumed from an asynchronous run's checkpoint: that batch is
                one version too stale for its window) draws its prompts again instead.
        Raises:
            RolloutError: the prefetched batch's file is missing or unreadable, or holds
                another rollout than the state names.
        """
        saved = state.get("prefetched")
        restored = None
        if saved and prefetched:
            if directory is None:
                raise RolloutError("the checkpoint holds a prefetched rollout; load_state needs "
                                   "its directory")
            path = Path(directory) / saved["file"]
            try:
                rollout_id, summary, samples = read_prefetched(path)
            except FileNotFoundError:
                raise RolloutError(f"{path}: the checkpoint's prefetched rollout is missing") from None
            if rollout_id != int(saved["rollout_id"]):
                raise RolloutError(f"{path}: holds rollout {rollout_id}, the checkpoint names "
                                   f"{saved['rollout_id']}")
            restored = (rollout_id, summary, samples)
        self.data.load_state_dict(state["data"])
        self.replacement_data.load_state_dict(state["replacement_data"])
        self.replacement_calls = int(state["replacement_calls"])
        self.next_sample_id = int(state["next_sample_id"])
        self.next_group_id = int(state["next_group_id"])
        self.batches.clear()
        self.batch_columns.clear()
        self.summaries.clear()
        self.data_state_before.clear()
        self.restored.clear()
        if restored is not None:
            rollout_id, summary, samples = restored
            self.batches[rollout_id] = samples
            self.summaries[rollout_id] = summary
            self.restored.add(rollout_id)
        elif saved:  # not restored: its prompts are drawn again, as before the draw
            self.data.load_state_dict(saved["data_before"])
