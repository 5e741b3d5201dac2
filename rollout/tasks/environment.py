"""Your own environment: tools the policy calls in its chat template's format (``--env``).

An environment is one class, a subclass of :class:`ToolEnvironment`, chosen by
``--env module:Class`` or by a name of :data:`replayrl.rollout.tasks.ENVIRONMENTS`. The task
(``--task``) still gives the prompts and the verifier; the environment answers the policy's
turns. One instance serves one trajectory (the rollout manager builds it with the run's
:class:`replayrl.rollout.config.RolloutConfig`), so it may keep per-episode state:

* ``await env.reset(prompt)`` once, before the first turn, with the trajectory's
  :class:`replayrl.rollout.text.data_source.Prompt` (``label``, ``metadata``, ``source``); it
  returns a :class:`Reset` (the tool schema the episode offers, ``None`` = the class's
  :attr:`ToolEnvironment.tools`; and optionally an opening observation, text or messages the
  first turn sees). The schema is rendered into every prompt by the chat template
  (``apply_chat_template(..., tools=ENV.tools)``) when the run's prompts are tokenised, so a
  prompt's ids are fixed before any turn and never re-tokenised; an opening observation is
  rendered alone and inserted before the prompt's generation prompt
  (:attr:`Reset.observation`);
* ``await env.step(turn)`` after each turn, with the :class:`Turn` the policy generated (its
  ids, its text and the tool calls :meth:`ToolEnvironment.parse_tool_calls` found in it); it
  returns a :class:`Step`: the observation (text, rendered by the chat template as a
  ``{"role": "tool"}`` message and appended as ids after the turn's exact ids; or token ids,
  appended as ``render_observation`` appends the digit calculator's), a reward and whether the
  episode is done. ``done`` (or no observation) ends the trajectory; its last turn is the
  final answer the verifier scores.

Each instance runs on a thread and event loop of its own
(``replayrl.rollout.episodes.env_worker``), and each call under ``--env-timeout-seconds``,
which holds for blocking code too (a ``time.sleep`` in ``step`` stalls only its trajectory).
Untrusted computation belongs in bounded code, as the shipped calculator's evaluator
(``examples/environments/python_calculator.py``), or in a subprocess with its own resource
limits. A call that raises, times out, answers something that is not a :class:`Step` (or text
that is not valid Unicode, or ids outside the vocabulary), or whose observation does not fit
the context left, ends that trajectory (status ``aborted``, counted in ``env_failures`` with a
message naming the prompt, the turn and the kind), or the run under ``--env-failure error``
(``replayrl.rollout.episodes.env_sessions``; docs/design/engines.md#environments).

The reward of a trajectory is ``--env-reward``: the verifier's (the task's ``--rm-type`` or
``--custom-reward``, the default), the sum of the environment's step rewards, or both added.

Tool calls are parsed from the turn's text; the default parser reads the Hermes / Qwen
format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (:func:`hermes_tool_calls`);
an environment overrides :meth:`ToolEnvironment.parse_tool_calls` for another format.

This is the one environment API the turn loop drives. A task's own environment
(``Task.environment()``: ``observe(prompt_ids, turn_ids)`` on token ids, :class:`Environment`)
is driven through it by :class:`ObserveAdapter`, one instance per trajectory like any other.
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.text.data_source import Prompt

__all__ = ["ToolCall", "Turn", "Reset", "Step", "ToolEnvironment", "Environment", "ObserveAdapter",
           "hermes_tool_calls", "check_step", "tool_result"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One tool call the policy wrote.

    Attributes:
        name: the tool's name (``""`` when the call could not be read).
        arguments: its arguments, read-only.
        error: why the call could not be read (``""`` when it could): the policy's mistake,
            which an environment answers (:func:`tool_result`), not an environment failure.
    """

    name: str
    arguments: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    error: str = ""


@dataclass(frozen=True)
class Turn:
    """One turn the policy generated.

    Attributes:
        index: the turn's number in its episode, from 0.
        ids: int32 ``[T]``, read-only: the tokens the engine sampled (end-of-turn id included).
        text: ``ids`` decoded, trailing stop ids left out, special tokens kept
            (``replayrl.rollout.episodes.env_sessions.turn_text``).
        tool_calls: the calls :meth:`ToolEnvironment.parse_tool_calls` found in ``text``.
        finish_reason: the engine's ``"stop"`` / ``"length"``.
    """

    index: int
    ids: np.ndarray
    text: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str


@dataclass(frozen=True)
class Reset:
    """What :meth:`ToolEnvironment.reset` gives.

    Attributes:
        tools: the tool schema of the episode (JSON-schema function descriptions, as
            ``apply_chat_template(tools=...)`` takes them); ``()`` = the class's.
        observation: the opening observation, seen before the first turn: text (one
            ``{"role": "tool"}`` message, e.g. a first tool result), a sequence of
            ``{"role": str, "content": str}`` messages (e.g. a system message describing the
            episode), or ``None`` (none). It is rendered by the chat template before the
            prompt's generation prompt and tokenised alone
            (``replayrl.rollout.text.tokenizer.PromptTokenizer.render_opening``): the trajectory's
            prompt ids become the exact prompt ids with these ids inserted, the ids the first
            engine call sees and the trainer trains on. Prompt positions are never trained
            (loss mask 0 by construction) and have no logprob or sampler-support rows.
    """

    tools: tuple[Mapping[str, Any], ...] = ()
    observation: str | tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True)
class Step:
    """What :meth:`ToolEnvironment.step` gives.

    Attributes:
        observation: the tool's answer: text (a tool message), int token ids (``[O]``,
            appended as the digit calculator's are), or ``None`` (nothing to answer: the turn
            was the final answer).
        reward: a finite float, summed over the episode's steps (``--env-reward env`` / ``sum``).
        done: the episode ends after this turn (its observation, if any, is not appended).
    """

    observation: str | np.ndarray | None = None
    reward: float = 0.0
    done: bool = False


def _blocks(text: str):
    """The bodies between each ``<tool_call>`` and the first ``</tool_call>`` after it, in
    order, each search starting after the last block's closer."""
    at = 0
    while (start := text.find(_OPEN, at)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            return
        yield text[start + len(_OPEN):end]
        at = end + len(_CLOSE)


def hermes_tool_calls(text: str) -> tuple[ToolCall, ...]:
    """The tool calls of ``text`` in the Hermes / Qwen chat-template format.

    Each ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` block is one call; a
    block whose body is not such a JSON object gives a :class:`ToolCall` with ``error`` set
    (never an exception, whatever the text: invalid JSON, JSON nested past the recursion limit,
    a number of over 4,300 digits; a malformed call is the policy's, answered as an error
    message). An unclosed ``<tool_call>`` (a turn cut at its length cap) is one call with an
    error.

    The blocks are found as ``re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)``
    finds them, in linear time: that regex retries every unclosed opener to the end of the
    text, quadratic in a turn that repeats ``<tool_call>`` (16,000 of them: 49 s, holding the
    GIL).

    Returns:
        the calls in order of appearance; ``()`` when the text has none.
    """
    calls = []
    for body in _blocks(text):
        try:
            obj = json.loads(body)
        except ValueError as exc:  # also a number of over 4,300 digits
            calls.append(ToolCall("", error=f"tool call is not JSON: {str(exc)[:200]}"))
            continue
        except RecursionError:  # nesting deeper than the interpreter's recursion limit
            calls.append(ToolCall("", error="tool call is not JSON: nested too deeply"))
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and isinstance(obj.get("arguments", {}), dict)):
            calls.append(ToolCall("", error='tool call must be {"name": str, "arguments": object}'))
            continue
        calls.append(ToolCall(obj["name"], MappingProxyType(dict(obj.get("arguments", {})))))
    if text.count(_OPEN) > text.count(_CLOSE):
        calls.append(ToolCall("", error="unclosed <tool_call>"))
    return tuple(calls)


def tool_result(call: ToolCall, value: str) -> str:
    """The observation text of one call: ``value``, or ``"error: ..."`` for an unreadable call."""
    return f"error: {call.error}" if call.error else value


def _shown(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, or its type when ``repr`` fails (an integer of
    over 4,300 digits, a hostile ``__repr__``)."""
    try:
        return repr(value)[:80]
    except Exception:
        return f"<{type(value).__name__}>"


def check_step(step: Any) -> str:
    """Why ``step`` is not a well-formed :class:`Step` (``""`` when it is).

    Well-formed: a :class:`Step` whose observation is ``None``, a ``str`` or a 1-d integer
    array / list of ints, whose reward is a finite real number and whose ``done`` is a bool.
    Never raises, whatever the fields hold (a ragged list, an integer too large for a float, an
    object whose ``repr`` raises): every such answer is malformed.
    """
    if not isinstance(step, Step):
        return f"step() returned {type(step).__name__}, not a Step"
    obs = step.observation
    if obs is not None and not isinstance(obs, str):
        try:
            arr = np.asarray(obs) if isinstance(obs, (list, tuple, np.ndarray)) else None
        except (ValueError, TypeError, OverflowError):  # ragged, or ints numpy cannot hold
            arr = None
        if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            return f"observation is {type(obs).__name__}, not text or a 1-d array of token ids"
    reward = step.reward
    try:
        finite = (not isinstance(reward, bool) and isinstance(reward, (int, float, np.integer,
                                                                       np.floating))
                  and math.isfinite(float(reward)))
    except (OverflowError, TypeError, ValueError):  # e.g. an int too large for a float
        finite = False
    if not finite:
        return f"reward {_shown(reward)} is not a finite number"
    if not isinstance(step.done, (bool, np.bool_)):
        return f"done {_shown(step.done)} is not a bool"
    return ""


class ToolEnvironment(ABC):
    """A multi-turn environment (see the module docstring); one instance per trajectory.

    Attributes:
        tools: the tool schema every prompt is rendered with (``apply_chat_template(tools=)``):
            a tuple of ``{"type": "function", "function": {"name", "description",
            "parameters"}}`` objects; ``()`` for an environment whose prompts describe their
            tools themselves.

    Args:
        config: the run's rollout settings (``None`` in tests that build one by hand).
    """

    tools: ClassVar[tuple[Mapping[str, Any], ...]] = ()

    def __init__(self, config: RolloutConfig | None = None) -> None:
        self.config = config

    def parse_tool_calls(self, text: str) -> tuple[ToolCall, ...]:
        """The tool calls of one turn's text (default: :func:`hermes_tool_calls`)."""
        return hermes_tool_calls(text)

    async def reset(self, prompt: Prompt) -> Reset | None:
        """Start the episode of ``prompt`` (default: nothing to set up; the class's tools)."""
        return Reset(tuple(self.tools))

    @abstractmethod
    async def step(self, turn: Turn) -> Step:
        """Answer one turn (see :class:`Step`). Raising ends this trajectory (or the run under
        ``--env-failure error``); so does running past ``--env-timeout-seconds``."""


class Environment(Protocol):
    """A task's own multi-turn environment (``Task.environment()``), on token ids; the turn loop
    drives it through :class:`ObserveAdapter`."""

    def observe(self, prompt_ids: Sequence[int], turn_ids: Sequence[int]) -> np.ndarray | None:
        """The observation tokens (int32 ``[O]``, loss mask 0 in the trajectory) that answer one
        turn (``turn_ids``, the tokens the policy generated) of the episode of ``prompt_ids``,
        or ``None`` when the turn is the final answer (the episode ends there)."""


class ObserveAdapter(ToolEnvironment):
    """A task's environment (``observe`` on token ids) behind the :class:`ToolEnvironment` API.

    One adapter serves one trajectory; every adapter of a run shares the one ``observer`` the
    task gave (``Task.environment()``), which it calls as :class:`Environment` specifies:
    :meth:`reset` keeps the prompt's ids, :meth:`step` answers a turn with
    ``observer.observe(prompt_ids, turn.ids)``, the token ids unchanged (``None``: the turn is
    the final answer, ``done``). It offers no tools and reads no text (the calls are whatever
    ``observe`` reads in the ids), and its step reward is 0 (the task's verifier scores). The
    turn loop's sessions drive it with ``failure="raise"``
    (``replayrl.rollout.episodes.env_sessions.EnvSessions.of_task``), so what ``observe``
    raises ends the run as it is.

    Args:
        observer: the task's environment: ``observe(prompt_ids: list[int], turn_ids: int
            array [T]) -> int array [O] | None``.
        config: the run's rollout settings (``None`` in tests).
    """

    def __init__(self, observer: Environment, config: RolloutConfig | None = None) -> None:
        super().__init__(config)
        self.observer = observer
        self.prompt_ids: list[int] = []

    def parse_tool_calls(self, text: str) -> tuple[ToolCall, ...]:
        """None from text: ``observe`` reads the calls from :attr:`Turn.ids` itself."""
        return ()

    async def reset(self, prompt: Prompt) -> None:
        """Keep the prompt's ids (ints), the ``prompt_ids`` every :meth:`step` passes on."""
        self.prompt_ids = [int(t) for t in prompt.prompt_ids]

    async def step(self, turn: Turn) -> Step:
        """``Step(observe(prompt_ids, turn.ids))``; ``done`` when that is ``None``.

        Raises:
            Whatever ``observe`` raises (the digit calculator:
            ``replayrl.rollout.errors.ToolEnvError``, a call on a prompt of another task).
        """
        observation = self.observer.observe(self.prompt_ids, turn.ids)
        return Step(observation=observation, done=observation is None)
