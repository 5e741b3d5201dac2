"""Trivial rollout engines for the engine-registry tests (registered by tests, never by default).

:class:`FixedDigitEngine` needs no model: row ``j`` of every ``generate`` call answers its
prompt ``<bos> op d1 .. dn =`` with ``d1 <eos>`` (even ``j``) or ``dn <eos>`` (odd ``j``), so
the reward of every trajectory is known from the prompt alone. Its traces are valid for the
embedded policy: support rows ``[y, y, -1, ...]`` (logprob 0 over a one-token support), experts
``0..K-1`` in every MoE layer, and each position's indexer keys the newest ``index_topk``
positions up to itself.

:class:`ToolCallingEngine` makes a multi-turn episode of every prompt: while its context holds
no calculator answer yet it calls the tool (the prompt's own operator), then answers as above.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from replayrl.rollout.engines.base import Engine, Generation
from replayrl.rollout.errors import EngineInputError
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.sample import TRACE_FIELDS
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


class FixedDigitEngine(Engine):
    """An :class:`Engine` answering the first / last prompt digit (see the module docstring).

    Args:
        model_config: ``ModelConfig`` fields (trace shapes and vocabulary).
        dtype: accepted and ignored (the launcher passes every engine the run's precision).
        device: accepted and ignored (the embedded engine's ``--device``, which tests that
            stand this engine in for it pass along with its other kwargs).
    """

    capturable_traces = frozenset(TRACE_FIELDS)

    def __init__(self, model_config: Mapping[str, Any], dtype: str = "bfloat16", device: str = "cpu") -> None:
        super().__init__()
        self.config = ModelConfig(**model_config)

    def _load_weights(self, arrays: Mapping[str, Any]) -> None:
        if not arrays:
            raise EngineInputError("load_weights: empty weight push")

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                  max_new_tokens: int, eos_token_id: int, seed: int,
                  traces: frozenset[str]) -> list[Generation]:
        cfg = self.config
        if max_new_tokens < 2:
            raise EngineInputError(f"max_new_tokens must be >= 2, got {max_new_tokens}")
        width = params.support_width(cfg.vocab_size)
        out = []
        for j, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt]
            response = np.array(self._response(j, prompt, eos_token_id), np.int32)
            rows = len(prompt) + len(response) - 1
            support = np.full((len(response), 1 + width), -1, np.int32)
            support[:, 0] = support[:, 1] = response
            experts = np.broadcast_to(np.arange(cfg.num_experts_per_tok, dtype=np.int32),
                                      (rows, len(cfg.moe_layers), cfg.num_experts_per_tok))
            keys = np.full((rows, len(cfg.indexed_layers), cfg.index_topk), -1, np.int32)
            for t in range(rows):
                newest = np.arange(t, max(t - cfg.index_topk, -1), -1)
                keys[t, :, :len(newest)] = newest
            out.append(Generation(
                response_ids=_read_only(response),
                rollout_logprobs=_read_only(np.zeros(len(response), np.float32)),
                sample_support=_read_only(support) if "sample_support" in traces else None,
                routed_experts=_read_only(experts.copy()) if "routed_experts" in traces else None,
                indexer_topk=_read_only(keys) if "indexer_topk" in traces else None,
                finish_reason="stop"))
        return out

    def _response(self, j: int, prompt: list[int], eos_token_id: int) -> list[int]:
        """Row ``j``'s turn for context ``prompt``: its first / last digit, then EOS."""
        return [prompt[2] if j % 2 == 0 else prompt[-2], eos_token_id]


class ToolCallingEngine(FixedDigitEngine):
    """Calls the calculator with the prompt's operator first (one token), then answers with
    the calculator's digit and EOS: every episode has two turns and one tool call."""

    EQUALS = VOCABULARY.index("=")

    def _response(self, j: int, prompt: list[int], eos_token_id: int) -> list[int]:
        if prompt.count(self.EQUALS) < 2:  # the prompt's own "=" only: no tool answer yet
            return [prompt[1]]
        return [prompt[-1], eos_token_id]  # the calculator's answer "= d": d


class NoRoutingEngine(FixedDigitEngine):
    """The same engine, declaring that it cannot capture MoE routing (R3)."""

    capturable_traces = frozenset({"sample_support", "indexer_topk"})


class ScriptedTurnsEngine(FixedDigitEngine):
    """Writes a fixed script of turns (token ids, each ending with the end-of-turn id) for any
    tokenizer: a context holding ``base + 2k`` end-of-turn ids gets turn ``k`` (each answered
    turn adds its own end-of-turn id and the tool turn's). For ``--env`` tests with a chat
    template: turn 0 a tool call, turn 1 the answer.

    Args:
        turns: the script, one id list per turn.
        base: end-of-turn ids in a rendered prompt.
    """

    def __init__(self, model_config: Mapping[str, Any], dtype: str = "bfloat16",
                 turns: Sequence[Sequence[int]] = (), base: int = 0, device: str = "cpu") -> None:
        super().__init__(model_config, dtype, device)
        self.turns = [list(t) for t in turns]
        self.base = int(base)

    def _response(self, j: int, prompt: list[int], eos_token_id: int) -> list[int]:
        return self.turns[(prompt.count(eos_token_id) - self.base) // 2]
