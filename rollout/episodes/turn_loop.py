"""The turn loop: trajectories of one or more engine turns, driven from the rollout side.

Each turn is one batched engine call (``generate_turn``, e.g. one ``EngineActor.generate``
request) over the trajectories still running, with the whole context (prompt, earlier turns,
observations) as the prompt. After a turn the batch's environment sessions
(``rollout/episodes/env_sessions.py``: an ``--env`` environment, or the task's own behind
``rollout/tasks/environment.py``'s ``ObserveAdapter``, the one API both speak) either answer a
tool call with observation ids, which are appended to the context, or end the episode. Without
an environment (single-turn runs, ``max_turns == 1``) every turn is final, so a single-turn
trajectory is this same loop stopped after turn 0.

The loop returns :class:`Episode` records -- turns, observations and the weight version of
each turn -- and :func:`assemble` turns one into a trajectory through
:func:`replayrl.rollout.traces.trajectory.merge_turns` (one assembly path for every trajectory), so:

* generated tokens keep their engine logprob and support row; observation tokens get
  loss_mask 0, logprob 0.0 and all ``-1`` support rows;
* ``routed_experts`` / ``indexer_topk`` have ``P + R - 1`` rows; each is the row the engine
  computed when it first forwarded that position (observation positions: the turn that
  consumed them), which is what the trainer's single full forward of prompt + response replays;
* every turn of a trajectory must come from one weight version (:class:`MixedVersionError`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection, Sequence

import numpy as np

from replayrl.rollout.engines.base import Generation
from replayrl.rollout.episodes.env_sessions import Answer, EnvSessions
from replayrl.rollout.errors import MixedVersionError, TurnLoopError
from replayrl.rollout.traces.trajectory import MergedTrajectory, merge_turns

__all__ = ["Episode", "GenerateTurn", "turn_seed",
           "run_episodes", "assemble"]

# (contexts, seed) -> (one Generation per context, the weight version that served them)
GenerateTurn = Callable[[list[list[int]], int], Awaitable[tuple[list[Generation], int]]]

FINAL = Answer(None)  # the answer to every turn without an environment: the turn is final


def turn_seed(seed: int, turn: int, max_turns: int) -> int:
    """The engine seed of turn ``turn`` of a run with ``max_turns`` turns per trajectory.

    A single-turn run (``max_turns == 1``) passes ``seed`` through unchanged; a multi-turn run
    derives ``SeedSequence([seed, turn])`` (so turn 0 differs from the single-turn seed). Both
    are the seeds the runs have always used: results stay bit-identical.

    Returns:
        int in ``[0, 2**32)`` for multi-turn runs, ``seed`` itself for single-turn runs.
    """
    if max_turns == 1:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(turn)]).generate_state(1, dtype=np.uint32)[0])


@dataclass(frozen=True)
class Episode:
    """The raw outcome of one trajectory's turn loop (assemble it with :func:`assemble`).

    Attributes:
        prompt_ids: the ``P`` prompt tokens (ints): the original prompt, or with an ``--env``
            environment's opening observation rendered in (``Reset.observation``).
        turns: ``n >= 1`` engine turns, in order.
        observations: ``n - 1`` int32 observation arrays, observation ``k`` after turn ``k``.
        versions: ``n`` weight versions, the one that served each turn.
        finish_reason: the final answer turn's ``"stop"`` / ``"length"``; ``"max_turns"`` when
            the last allowed turn was a tool call; ``"length"`` when another turn would outgrow
            the model's positions.
        num_tool_calls: tool calls the environment answered or refused at the turn limit.
        env_reward: the sum of an ``--env`` environment's step rewards (0.0 without one).
        failure: ``""``, or why an ``--env`` environment ended the trajectory
            (``finish_reason == "env_error"``; the message names the prompt and the turn).
        parse_errors: tool calls of its turns the environment's parser could not read
            (``ToolCall.error``: not JSON, not ``{"name", "arguments"}``, unclosed).
    """

    prompt_ids: tuple[int, ...]
    turns: tuple[Generation, ...]
    observations: tuple[np.ndarray, ...]
    versions: tuple[int, ...]
    finish_reason: str
    num_tool_calls: int
    env_reward: float = 0.0
    failure: str = ""
    parse_errors: int = 0


async def run_episodes(
    generate_turn: GenerateTurn,
    prompts: Sequence[Sequence[int]],
    *,
    max_turns: int,
    max_new_tokens: int,
    max_positions: int,
    seed: int,
    env: EnvSessions | None,
) -> list[Episode]:
    """Run the turn loop for a batch of trajectories on one engine.

    Args:
        generate_turn: ``await generate_turn(contexts, seed)`` -> ``(generations, version)``,
            one engine call over the running trajectories (batched as given).
        prompts: ``B >= 1`` task prompts (int ids), one trajectory each.
        max_turns: generated turns per trajectory at most, ``>= 1``. A tool call in the last
            allowed turn ends the trajectory without an observation.
        max_new_tokens: new tokens per turn, ``>= 1``.
        max_positions: the model's ``max_position_embeddings``: a trajectory whose next turn
            would not fit ends with ``"length"``.
        seed: ``>= 0``; turn ``t`` uses :func:`turn_seed(seed, t, max_turns) <turn_seed>`.
            Same seed, prompts and weights give the same episodes.
        env: the batch's environment sessions
            (:class:`replayrl.rollout.episodes.env_sessions.EnvSessions`, row ``i`` =
            ``prompts[i]``: an ``--env`` environment's, or the task's own through
            ``EnvSessions.of_task``), or ``None`` (no tools: every turn is final). Their
            answers come rendered already (``PromptTokenizer.render_tool_text`` /
            ``render_observation``: the separator the chat template writes after the turn's
            end-of-turn token, then the tool turn), so the next turn's context is the previous
            context's exact ids plus the turn's ids plus these, never a re-tokenisation of the
            conversation's text (docs/design/prompt-data.md#prompt-data). A failure ends that
            trajectory with ``"env_error"``, and so does an observation longer than the context
            left for it -- the positions after the turn minus one for the next turn's first
            token -- unless the sessions leave it to ``"length"`` (``EnvSessions.too_long``: the
            task's own environment); a row whose reset gave an opening observation starts from
            ``sessions.openings[i]`` instead of ``prompts[i]``, or, when that leaves fewer than
            ``max_new_tokens`` positions, from ``prompts[i]`` with its first turn ending it.

    Returns:
        ``B`` :class:`Episode` records in prompt order.

    Raises:
        TurnLoopError: ``max_turns`` / ``max_new_tokens`` / ``max_positions`` / ``seed`` not an
            int in range, ``env`` not sessions or for another number of prompts, or
            ``generate_turn`` returned a wrong number of generations.
        Whatever the sessions raise (``EnvSessions.start`` / ``EnvSessions.respond``): the
            chat template's ``replayrl.rollout.errors.ChatTemplateError``, naming the row; a
            task environment's own errors (the digit task's calculator:
            ``replayrl.rollout.errors.ToolEnvError``, a tool call on a prompt that is not a
            task prompt); ``replayrl.rollout.errors.EnvironmentFailure``, an ``--env`` failure
            under ``--env-failure error``.
        Whatever ``generate_turn`` raises (e.g. the engine's errors, over the wire).
    """
    for name, value, low in (("max_turns", max_turns, 1), ("max_new_tokens", max_new_tokens, 1),
                             ("max_positions", max_positions, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise TurnLoopError(f"{name} must be an int >= {low}, got {value!r}")
    sessions = env
    if sessions is not None and not isinstance(sessions, EnvSessions):
        raise TurnLoopError(f"env must be EnvSessions or None, got {type(env).__name__} (a task's "
                            "observe environment: EnvSessions.of_task(env, prompts))")
    if sessions is not None and len(sessions.prompts) != len(prompts):
        raise TurnLoopError(f"the environment sessions hold {len(sessions.prompts)} prompts, "
                            f"not the {len(prompts)} given")
    originals = [[int(t) for t in p] for p in prompts]
    try:
        return await _turns(generate_turn, sessions, originals, max_turns=int(max_turns),
                            max_new_tokens=int(max_new_tokens), max_positions=int(max_positions),
                            seed=seed)
    finally:  # the environments' threads go, however the loop ended (a blocked one: later)
        if sessions is not None:
            sessions.close()


async def _turns(generate_turn: GenerateTurn, sessions: EnvSessions | None,
                 originals: list[list[int]], *, max_turns: int, max_new_tokens: int,
                 max_positions: int, seed: int) -> list[Episode]:
    """The loop of :func:`run_episodes`, its arguments checked."""
    contexts = [list(p) for p in originals]
    turns: list[list[Generation]] = [[] for _ in originals]
    versions: list[list[int]] = [[] for _ in originals]
    observations: list[list[np.ndarray]] = [[] for _ in originals]
    finish: list[str | None] = [None] * len(originals)
    tool_calls = [0] * len(originals)
    env_rewards = [0.0] * len(originals)
    failures = [""] * len(originals)
    if sessions is not None:
        await sessions.start(max_positions - max_new_tokens)
        for i, opened in enumerate(sessions.openings):  # a reset's opening observation
            if opened is None:
                continue
            if len(opened) + int(max_new_tokens) > max_positions:
                sessions.fail_opening(i, f"the prompt with its opening observation is "
                                         f"{len(opened)} tokens; with {max_new_tokens} new tokens "
                                         f"per turn it does not fit the {max_positions} positions")
            else:
                originals[i] = [int(t) for t in opened]
                contexts[i] = list(originals[i])
    active = list(range(len(originals)))
    for t in range(int(max_turns)):
        if not active:
            break
        gens, version = await generate_turn([contexts[i] for i in active],
                                            turn_seed(seed, t, max_turns))
        if len(gens) != len(active):
            raise TurnLoopError(f"turn {t}: the engine returned {len(gens)} generations for "
                                f"{len(active)} prompts")
        # the room an observation has: the positions after the turn, less one for the next
        answers = (await asyncio.gather(*(sessions.respond(
                       i, t, gen, max_positions - len(contexts[i]) - len(gen.response_ids) - 1)
                       for i, gen in zip(active, gens)))
                   if sessions is not None else [FINAL] * len(active))
        still = []
        for i, gen, answer in zip(active, gens, answers):
            turns[i].append(gen)
            versions[i].append(version)
            env_rewards[i] += answer.reward
            if answer.failure:
                finish[i], failures[i] = "env_error", answer.failure
                continue
            obs = answer.observation
            if obs is None:
                finish[i] = gen.finish_reason
                continue
            tool_calls[i] += 1
            grown = len(contexts[i]) + len(gen.response_ids) + len(obs)
            left = max_positions - len(contexts[i]) - len(gen.response_ids) - 1
            if t + 1 == max_turns:
                finish[i] = "max_turns"
            elif grown + 1 > max_positions and (too_long := sessions.too_long(
                    i, t, len(obs), left, max_positions)):
                finish[i], failures[i] = "env_error", too_long
            elif grown + int(max_new_tokens) - 1 > max_positions:
                finish[i] = "length"  # another turn would not fit the model's positions
            else:
                contexts[i] += [int(x) for x in gen.response_ids] + [int(x) for x in obs]
                observations[i].append(obs)
                still.append(i)
        active = still
    return [Episode(tuple(originals[i]), tuple(turns[i]), tuple(observations[i]),
                    tuple(versions[i]), finish[i], tool_calls[i], env_rewards[i], failures[i],
                    sessions.parse_errors[i] if sessions is not None else 0)
            for i in range(len(originals))]


def assemble(episode: Episode, *, sample_id: int,
             require: Collection[str]) -> tuple[MergedTrajectory, int]:
    """The trajectory of one episode: its one policy version and its merged turns.

    Args:
        episode: a :func:`run_episodes` record.
        sample_id: named in every error.
        require: trace fields every turn must carry (``replayrl.rollout.sample.required_traces``).

    Returns:
        ``(merged, version)``: :func:`replayrl.rollout.traces.trajectory.merge_turns` of the turns and
        observations, and the weight version every turn was served by.

    Raises:
        MixedVersionError: the turns were served by different weight versions.
        replayrl.rollout.errors.TrajectoryError (and subclasses): see ``merge_turns`` (e.g. a
            required trace missing).
    """
    if len(set(episode.versions)) != 1:
        raise MixedVersionError(sample_id, "policy_version",
                                f"turns served by different weight versions "
                                f"{list(episode.versions)}; "
                                "a trajectory must come from one policy")
    merged = merge_turns(episode.prompt_ids, episode.turns, episode.observations,
                         sample_id=sample_id, require=require)
    return merged, episode.versions[0]
