"""Multi-turn generation with a tool environment on the embedded engine.

Each turn is one batched :meth:`rollout.engine.EmbeddedEngine.generate` call over the
trajectories still running, with the whole context (prompt, earlier turns, observations) as
the prompt. After a turn the environment (``rollout/tool_env.py``) either answers a tool call
with observation tokens, which are appended to the context, or ends the episode. The turns and
observations are then assembled by :func:`rollout.trajectory.merge_turns`, which routes every
trace through :class:`rollout.trace.TokenMetadataTrace`, so:

* generated tokens keep their engine logprob and support row; observation tokens get
  loss_mask 0, logprob 0.0 and all ``-1`` support rows;
* ``routed_experts`` / ``indexer_topk`` have ``P + R - 1`` rows; each is the row the engine
  computed when it first forwarded that position (observation positions: the turn that
  consumed them), which is what the trainer's single full forward of prompt + response replays.

Traces the engine is configured to capture are required: a trajectory whose turn lacks one is
an error (``merge_turns``), never a sample trained without replay.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rollout.engine import EmbeddedEngine
from rollout.sampler import SamplingParams
from rollout.tool_env import DigitToolEnv
from rollout.trajectory import merge_turns

__all__ = ["MultiTurnError", "turn_seed", "generate_multi_turn"]


class MultiTurnError(ValueError):
    """A generate_multi_turn argument is malformed (the message names it)."""


def turn_seed(seed: int, turn: int) -> int:
    """The engine seed of turn ``turn`` (a pure function of ``(seed, turn)``, in [0, 2**32))."""
    return int(np.random.SeedSequence([int(seed), int(turn)]).generate_state(1, dtype=np.uint32)[0])


def _required_traces(engine: EmbeddedEngine) -> tuple[str, ...]:
    required = ["sample_support"]  # the embedded engine always records support rows
    if engine.capture_routing and engine.config.moe_layers:
        required.append("routed_experts")
    if engine.capture_indexer and engine.config.indexed_layers:
        required.append("indexer_topk")
    return tuple(required)


def generate_multi_turn(
    engine: EmbeddedEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    max_turns: int,
    max_new_tokens: int,
    eos_token_id: int,
    seed: int,
    env: DigitToolEnv | None = None,
) -> list[dict[str, Any]]:
    """Generate one multi-turn trajectory per prompt.

    Args:
        engine: an embedded engine with weights loaded.
        prompts: ``B >= 1`` task prompts (``<bos> op d1 .. dn =``, int ids).
        params: sampling parameters of every turn.
        max_turns: generated turns per trajectory at most, ``>= 1``. A tool call in the last
            allowed turn ends the trajectory without an observation.
        max_new_tokens: new tokens per turn, ``>= 1``.
        eos_token_id: ends a turn when sampled (a tool-call turn may end with it too).
        seed: ``>= 0``; turn ``t`` uses engine seed :func:`turn_seed(seed, t) <turn_seed>`.
            Same seed, prompts, params and weights give the same trajectories.
        env: the tool environment (default :class:`DigitToolEnv` on the default task).

    Returns:
        ``B`` dicts in prompt order with the per-token fields of :class:`rollout.sample.Sample`
        -- ``response_ids`` int32 ``[R]``, ``loss_mask`` uint8 ``[R]``, ``rollout_logprobs``
        float32 ``[R]``, ``sample_support`` int32 ``[R, 1+W]``, ``routed_experts`` int32
        ``[P+R-1, L, K]`` or None, ``indexer_topk`` int32 ``[P+R-1, L_idx, K_idx]`` or None
        (None when the engine does not capture it) -- plus ``finish_reason``: the final answer
        turn's ``"stop"`` / ``"length"``, ``"max_turns"`` when the last allowed turn was a tool
        call, or ``"length"`` when the context would outgrow the model's
        ``max_position_embeddings`` with another turn; ``num_turns`` and ``num_tool_calls``.
        Score a trajectory with ``env.reward(response_ids, loss_mask, answer_id)``.

    Raises:
        MultiTurnError: ``max_turns`` / ``max_new_tokens`` / ``seed`` not an int in range.
        rollout.engine.EngineError (and subclasses): from the engine, e.g. the prompt alone
            does not fit ``max_position_embeddings``; trajectories are named by prompt index.
        rollout.trajectory.TrajectoryError: a turn's traces are inconsistent or missing
            (``sample_id`` = the prompt's index in ``prompts``).
        rollout.tool_env.ToolEnvError: a tool call on a prompt that is not a task prompt.
    """
    for name, value, low in (("max_turns", max_turns, 1), ("max_new_tokens", max_new_tokens, 1),
                             ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise MultiTurnError(f"{name} must be an int >= {low}, got {value!r}")
    env = env if env is not None else DigitToolEnv()
    max_positions = engine.config.max_position_embeddings
    originals = [[int(t) for t in p] for p in prompts]
    contexts = [list(p) for p in originals]
    turns: list[list[Any]] = [[] for _ in originals]
    observations: list[list[np.ndarray]] = [[] for _ in originals]
    finish: list[str | None] = [None] * len(originals)
    tool_calls = [0] * len(originals)
    active = list(range(len(originals)))
    for t in range(int(max_turns)):
        if not active:
            break
        gens = engine.generate([contexts[i] for i in active], params,
                               max_new_tokens=int(max_new_tokens), eos_token_id=eos_token_id,
                               seed=turn_seed(seed, t))
        still = []
        for i, gen in zip(active, gens):
            turns[i].append(gen)
            obs = env.observe(originals[i], gen.response_ids)
            if obs is None:
                finish[i] = gen.finish_reason
                continue
            tool_calls[i] += 1
            grown = len(contexts[i]) + len(gen.response_ids) + len(obs)
            if t + 1 == max_turns:
                finish[i] = "max_turns"
            elif grown + int(max_new_tokens) - 1 > max_positions:
                finish[i] = "length"  # another turn would not fit the model's positions
            else:
                contexts[i] += [int(x) for x in gen.response_ids] + [int(x) for x in obs]
                observations[i].append(obs)
                still.append(i)
        active = still

    required = _required_traces(engine)
    out = []
    for i, prompt in enumerate(originals):
        merged = merge_turns(prompt, turns[i], observations[i], sample_id=i, require=required)
        out.append({**merged.sample_fields(), "finish_reason": finish[i],
                    "num_turns": merged.num_turns, "num_tool_calls": tool_calls[i]})
    return out
