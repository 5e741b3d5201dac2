"""The RolloutManager actor: turns prompt groups into scored trajectories.

For each ``rollout_id`` it draws ``rollout_batch_size`` prompts from the seeded data source,
asks the engine actors for ``n_samples_per_prompt`` trajectories per prompt (groups are split
across engines, whole groups per engine), scores them with the task's verifier and keeps the
batch until the trainer takes it, so the trajectories cross the wire once (engine -> manager ->
trainer), never through the driver. Its data-source state is checkpointable.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from actors import Actor, concurrent, import_callable
from rollout.config import RolloutConfig
from rollout.data_source import Prompt, PromptDataSource
from rollout.sample import Sample, SampleError
from rollout.task import DigitTask
from rollout.tool_env import DigitToolEnv
from rollout.trajectory import merge_turns


def observation_segments(loss_mask: np.ndarray) -> int:
    """Number of maximal runs of observation tokens (loss mask 0): one per tool call answered."""
    obs = np.asarray(loss_mask) == 0
    return int(obs[0]) + int(np.count_nonzero(obs[1:] & ~obs[:-1])) if len(obs) else 0


class RolloutError(RuntimeError):
    """A rollout could not be produced or handed over (names the rollout id)."""


def _load_function(path: str):
    """The callable named ``module:function`` (``--custom-reward``).

    Raises:
        RolloutError: not importable or not callable.
    """
    try:
        return import_callable(path)
    except ValueError as exc:
        raise RolloutError(f"--custom-reward {exc}") from None


class RolloutManager(Actor):
    """Actor that produces and stores rollout batches.

    Args:
        config: :meth:`RolloutConfig.to_dict` output.
        engines: names of the engine actors in the run's directory.
        require_traces: trace fields the trainer replays (e.g. ``routed_experts`` with R3 on);
            a trajectory without one is an error at conversion time, never trained silently.
    """

    def __init__(self, config: dict, engines: list[str], require_traces: list[str] = ()) -> None:
        self.config = RolloutConfig(**config)
        if not engines:
            raise RolloutError("RolloutManager needs at least one engine")
        self.engines = list(engines)
        self.task = DigitTask(num_digits=self.config.num_digits, num_values=self.config.num_values)
        self.tool_env = DigitToolEnv(self.task)
        self.custom_reward = _load_function(self.config.custom_reward) if self.config.custom_reward else None
        self.require_traces = tuple(require_traces)
        self.data = PromptDataSource(self.task, self.config.seed, self.config.dataset_size)
        self.replacement_data = PromptDataSource(self.task, self.config.seed + 7919,
                                                 self.config.dataset_size)
        self.replacement_calls = 0
        self.data_state_before: dict[int, dict] = {}
        self.batches: dict[int, list[Sample]] = {}
        self.next_sample_id = 0
        self.next_group_id = 0

    async def _generate_groups(self, prompts: list[Prompt], rollout_id: int,
                               seed_key: list[int]) -> list[Sample]:
        """Generate ``n_samples_per_prompt`` trajectories per prompt and score them."""
        cfg = self.config
        group_ids = list(range(self.next_group_id, self.next_group_id + len(prompts)))
        self.next_group_id += len(prompts)
        chunks = [list(range(i, len(prompts), len(self.engines))) for i in range(len(self.engines))]
        seeds = np.random.SeedSequence([cfg.seed, *seed_key]).generate_state(len(self.engines))
        method, extra = ("generate", {}) if cfg.max_turns == 1 else (
            "generate_multi_turn", {"max_turns": cfg.max_turns})
        replies = await asyncio.gather(*(
            self.ref(engine).call(
                method, [prompts[g].prompt_ids for g in chunk for _ in range(cfg.n_samples_per_prompt)],
                cfg.sampling_dict(), max_new_tokens=cfg.max_response_len,
                eos_token_id=self.task.eos_id, seed=int(seed), timeout=cfg.generate_timeout_s, **extra)
            for engine, chunk, seed in zip(self.engines, chunks, seeds) if chunk))
        samples: list[Sample] = []
        for chunk, reply in zip([c for c in chunks if c], replies):
            gens = iter(reply["generations"])
            for g in chunk:
                for _ in range(cfg.n_samples_per_prompt):
                    samples.append(self._to_sample(next(gens), prompts[g], group_ids[g],
                                                   rollout_id, reply["version"]))
        samples.sort(key=lambda s: (s.group_id, s.sample_id))  # groups contiguous for GRPO
        return samples

    @concurrent
    async def generate(self, rollout_id: int) -> dict:
        """Generate, score and store one batch; returns its summary (floats, seconds).

        Raises:
            RolloutError: a batch with this id is already stored.
            actors.RemoteError / ActorTimeout: an engine failed or did not answer in time.
        """
        if rollout_id in self.batches:
            raise RolloutError(f"rollout {rollout_id} already generated and not yet taken")
        start = time.perf_counter()
        # The data state before this draw is what a checkpoint taken before training on this
        # rollout must record: a prefetched batch the model never trained on is drawn again.
        self.data_state_before[rollout_id] = self.data.state_dict()
        prompts = self.data.next_batch(self.config.rollout_batch_size)  # before any await
        samples = await self._generate_groups(prompts, rollout_id, [rollout_id])
        self.batches[rollout_id] = samples
        rewards = np.array([s.reward for s in samples])
        summary = {"rollout_id": rollout_id, "samples": len(samples),
                   "reward_mean": float(rewards.mean()),
                   "response_len_mean": float(np.mean([len(s.response_ids) for s in samples])),
                   "truncated_fraction": float(np.mean([s.status == "truncated" for s in samples])),
                   "policy_versions": sorted({s.policy_version for s in samples}),
                   "prompt_indices": [p.index for p in prompts],
                   "generate_seconds": time.perf_counter() - start}
        if self.config.max_turns > 1:
            summary["tool_calls_mean"] = float(np.mean([observation_segments(s.loss_mask)
                                                        for s in samples]))
        return summary

    @concurrent
    async def generate_replacements(self, n_groups: int) -> list[dict]:
        """Exact refill: ``n_groups`` fresh prompt groups from the current policy, as sample dicts.

        Replacement prompts come from their own seeded stream, so refill never shifts the prompts
        of later rollouts (a resumed run sees the same batches). Samples carry the version of the
        engine that generated them; the trainer has the VersionClock check it.
        """
        if n_groups < 1:
            raise RolloutError(f"generate_replacements needs n_groups >= 1, got {n_groups}")
        self.replacement_calls += 1
        prompts = self.replacement_data.next_batch(n_groups)
        samples = await self._generate_groups(prompts, -1, [1 << 20, self.replacement_calls])
        return [s.to_dict() for s in samples]

    def _to_sample(self, gen: dict, prompt: Prompt, group_id: int, rollout_id: int,
                   version: int) -> Sample:
        sample_id = self.next_sample_id
        self.next_sample_id += 1
        if self.config.max_turns == 1:  # one engine turn: assemble through the same checks
            fields = merge_turns(prompt.prompt_ids, [gen], [], sample_id=sample_id,
                                 require=self.require_traces).sample_fields()
            reward = self.task.reward(fields["response_ids"], prompt.answer_id)
        else:
            missing = [f for f in self.require_traces if gen.get(f) is None]
            if missing:
                raise SampleError(sample_id, missing[0], "missing while its replay is enabled")
            fields = {k: gen[k] for k in ("response_ids", "loss_mask", "rollout_logprobs",
                                          "sample_support", "routed_experts", "indexer_topk")}
            reward = self.tool_env.reward(np.asarray(gen["response_ids"]), np.asarray(gen["loss_mask"]),
                                          prompt.answer_id)
        if self.custom_reward is not None:
            reward = float(self.custom_reward(prompt.prompt_ids, fields["response_ids"],
                                              fields["loss_mask"], prompt.answer_id, self.config))
        return Sample(sample_id=sample_id, group_id=group_id, rollout_id=rollout_id,
                      policy_version=version, prompt_ids=prompt.prompt_ids, reward=reward,
                      status="completed" if gen["finish_reason"] == "stop" else "truncated",
                      **fields)

    async def take_batch(self, rollout_id: int) -> list[dict]:
        """Hand over (and forget) a stored batch as sample dicts, groups contiguous.

        Raises:
            RolloutError: no batch with this id is stored.
        """
        self.data_state_before.pop(rollout_id - 1, None)  # older snapshots are never needed
        try:
            samples = self.batches.pop(rollout_id)
        except KeyError:
            raise RolloutError(f"rollout {rollout_id} is not stored; have {sorted(self.batches)}") from None
        return [s.to_dict() for s in samples]

    async def state(self, next_rollout_id: int | None = None) -> dict:
        """Checkpointable state.

        Args:
            next_rollout_id: the first rollout the resumed run will generate; the data state is
                taken from before that rollout's draw when it was already prefetched.
        """
        data = self.data.state_dict()
        if next_rollout_id is not None and next_rollout_id in self.data_state_before:
            data = self.data_state_before[next_rollout_id]
        return {"data": data, "replacement_data": self.replacement_data.state_dict(),
                "replacement_calls": self.replacement_calls,
                "next_sample_id": self.next_sample_id, "next_group_id": self.next_group_id}

    async def load_state(self, state: dict) -> None:
        """Restore :meth:`state` output (drops stored, untrained batches)."""
        self.data.load_state_dict(state["data"])
        self.replacement_data.load_state_dict(state["replacement_data"])
        self.replacement_calls = int(state["replacement_calls"])
        self.next_sample_id = int(state["next_sample_id"])
        self.next_group_id = int(state["next_group_id"])
        self.batches.clear()
        self.data_state_before.clear()
