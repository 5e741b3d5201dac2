"""One batch's environment sessions: the turn loop's one way to an environment (``rollout/tasks/environment.py``).

:class:`EnvSessions` holds one :class:`replayrl.rollout.tasks.environment.ToolEnvironment`
instance per trajectory of an engine batch, resets them, and answers each turn with the ids
to append (the observation rendered by the chat template as a tool message, tokenised alone:
``PromptTokenizer.render_tool_text``; or token ids, through ``render_observation``).

An ``--env`` environment is the user's code, so each instance runs on a thread and event loop
of its own (:class:`replayrl.rollout.episodes.env_worker.EnvWorker`: its construction, its
``reset``, and each turn's ``parse_tool_calls`` and ``step``), never on the loop that serves
the rollout manager: a ``time.sleep`` in an ``async def step`` blocks only its own
trajectory, and the per-call time limit holds for it. A call that raises, runs past the limit,
answers a malformed step, or an observation that cannot fit the context (refused by its size,
before it is tokenised) gives a failure message (naming the environment, the prompt, the row,
the turn and the kind) that ends that trajectory (``run_episodes``: ``finish_reason ==
"env_error"``), or, with ``failure="error"``, raises
:class:`replayrl.rollout.errors.EnvironmentFailure` and ends the run. :meth:`EnvSessions.close`
lets the threads go (never waiting for one that is blocked; ``env_worker`` bounds those).

A task's own environment (``observe`` on token ids) is driven the same way, each trajectory's
behind a :class:`replayrl.rollout.tasks.environment.ObserveAdapter`
(:meth:`EnvSessions.of_task`), with ``failure="raise"``: it is part of the task, so what it
raises ends the run as it is, with no time limit, on the caller's loop (its rows share one
``observe`` object, which is not called from several threads), and an observation too long for
the context ends its trajectory with ``"length"`` as any turn that outgrows the positions.
"""
from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from replayrl.rollout.episodes.env_worker import EnvWorker, check_stranded
from replayrl.rollout.errors import CallExited, EnvironmentFailure, ToolCallParseFailed, TurnLoopError
from replayrl.rollout.tasks.environment import Environment, ObserveAdapter, Reset, ToolEnvironment, Turn, check_step
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.traces.trace import INT32_MAX

__all__ = ["Answer", "EnvSessions", "turn_text"]

ENV_FAILURES = ("abort", "error")  # what --env-failure may say
# ... and "raise": the task's own environment, whose errors are the run's (EnvSessions.of_task)
SESSION_FAILURES = (*ENV_FAILURES, "raise")


@dataclass(frozen=True)
class Answer:
    """The environment's answer to one turn, ready for the turn loop.

    Attributes:
        observation: read-only int32 ``[O]`` ids to append (loss mask 0), or ``None`` when the
            episode ends after this turn.
        reward: the step's reward (float).
        failure: ``""``, or the message of a failure that ends this trajectory.
    """

    observation: np.ndarray | None
    reward: float = 0.0
    failure: str = ""


def turn_text(tokenizer: Any, ids: np.ndarray) -> str:
    """The text of one turn as the parser reads it: ``ids`` without their trailing stop ids
    (``tokenizer.eos_token_ids``), decoded with special tokens kept (a template whose
    ``<tool_call>`` is a special token still shows it)."""
    end = len(ids)
    while end and int(ids[end - 1]) in tokenizer.eos_token_ids:
        end -= 1
    return tokenizer.tokenizer.decode([int(t) for t in ids[:end]], skip_special_tokens=False)


def _not_utf8(text: str) -> str:
    """Why ``text`` cannot be tokenised (``""`` when it can): a lone surrogate, which UTF-8
    cannot encode (e.g. bytes decoded with ``errors="surrogateescape"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"the text is not valid Unicode ({exc.reason} at character {exc.start})"
    return ""


def _check_opening(observation: Any) -> str:
    """Why a reset's opening observation is malformed (``""`` when it is UTF-8-encodable text
    or a non-empty sequence of ``{"role": str, "content": str}`` mappings)."""
    if isinstance(observation, str):
        return (_not_utf8(observation) if observation
                else "reset() returned an empty opening observation")
    if (isinstance(observation, (list, tuple)) and observation
            and all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in observation)):
        return next(filter(None, (_not_utf8(m["role"] + m["content"]) for m in observation)), "")
    return (f"reset() returned an opening observation of type {type(observation).__name__}, "
            "not text or a non-empty sequence of {'role': str, 'content': str} messages")


_CHARS_PER_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chars_per_token(tokenizer: Any) -> int | None:
    """The most characters one token of ``tokenizer`` (a ``PromptTokenizer``) stands for: its
    longest vocabulary string (byte-level BPE: one character per byte, never fewer than the
    text's characters), ``None`` when the tokenizer has no vocabulary to read. Text longer than
    ``n`` times this cannot tokenise to ``n`` tokens or fewer, so a giant observation is refused
    before it is tokenised. Cached per tokenizer."""
    inner = getattr(tokenizer, "tokenizer", None)
    try:
        return _CHARS_PER_TOKEN[inner]
    except (KeyError, TypeError):
        pass
    try:
        most = max(map(len, inner.get_vocab()), default=0)
    except Exception:  # no get_vocab (a test's stand-in): no bound
        return None
    most = max(int(most), 1)
    try:
        _CHARS_PER_TOKEN[inner] = most
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return most


def _error_text(exc: BaseException) -> str:
    """``"Type: message"`` of an environment's exception, the message cut to 2,000 characters
    (or ``<unprintable>`` when its ``__str__`` raises)."""
    if isinstance(exc, CallExited) and exc.__cause__ is not None:
        exc = exc.__cause__  # sys.exit() in the environment: name SystemExit itself
    try:
        message = str(exc)[:2000]
    except Exception:
        message = "<unprintable>"
    return f"{type(exc).__name__}: {message}"


class EnvSessions:
    """The environment instances of one batch of trajectories (row ``i`` = ``prompts[i]``).

    Args:
        make_env: builds one fresh environment (called once per row).
        prompts: the batch's prompts, one per trajectory.
        tokenizer: a :class:`replayrl.rollout.text.tokenizer.PromptTokenizer` (decodes turns,
            renders observations), or ``None``: turns come with ids only (:attr:`Turn.text`
            ``""``) and id observations are appended unchanged (a task's environment run
            without a tokenizer, as the tests run the turn loop).
        timeout_s: seconds one ``reset`` / ``step`` may take (building the instance counts
            with its reset; parsing the turn with its step), > 0; ``None``: no limit. It holds
            for blocking code too: the environment runs on a thread of its own
            (:class:`replayrl.rollout.episodes.env_worker.EnvWorker`), except under
            ``failure="raise"``.
        failure: ``"abort"`` (end the trajectory), ``"error"`` (raise
            :class:`EnvironmentFailure`, ending the run) or ``"raise"`` (a task's own
            environment: what it raises propagates unchanged, a malformed answer raises
            :class:`EnvironmentFailure`, and an observation too long for the context is left to
            the turn loop's ``"length"``; see the module docstring).
        name: the environment as messages name it (``--env``'s value).
    Raises:
        ValueError: ``timeout_s <= 0`` or an unknown ``failure``.
    """

    def __init__(self, make_env: Callable[[], ToolEnvironment], prompts: Sequence[Prompt], *,
                 tokenizer: Any, timeout_s: float | None, failure: str = "abort",
                 name: str = "") -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if failure not in SESSION_FAILURES:
            raise ValueError(f"failure must be one of {SESSION_FAILURES}, got {failure!r}")
        self.make_env = make_env
        self.prompts = list(prompts)
        self.tokenizer = tokenizer
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.failure = failure
        self.name = name or "environment"
        self.envs: list[ToolEnvironment | None] = [None] * len(self.prompts)
        self.failed: list[str] = [""] * len(self.prompts)
        # per row: the thread the environment runs on (None: on the caller's loop, "raise")
        self.workers: list[EnvWorker | None] = [None] * len(self.prompts)
        # per row: the prompt ids with the reset's opening observation rendered in, or None
        self.openings: list[np.ndarray | None] = [None] * len(self.prompts)
        # per row: tool calls the parser could not read (ToolCall.error), the policy's mistakes
        self.parse_errors: list[int] = [0] * len(self.prompts)

    @classmethod
    def of_task(cls, observer: Environment, prompts: Sequence[Prompt], *,
                tokenizer: Any = None) -> EnvSessions:
        """The sessions of a task's own environment (``Task.environment()``): one
        :class:`ObserveAdapter` of ``observer`` per row, ``failure="raise"``, no time limit,
        named after ``observer``'s class.

        Args:
            observer: the task's environment (``observe(prompt_ids, turn_ids)``).
            prompts: the batch's prompts (each row's ``prompt_ids`` is what ``observe`` gets).
            tokenizer: as for :class:`EnvSessions` (``render_observation`` renders the ids).
        """
        return cls(lambda: ObserveAdapter(observer), prompts, tokenizer=tokenizer,
                   timeout_s=None, failure="raise", name=type(observer).__name__)

    def _where(self, row: int, turn: int | None) -> str:
        p = self.prompts[row]
        at = "reset" if turn is None else f"turn {turn}"
        return f"{self.name} at prompt {p.source or p.index} (row {row}), {at}"

    def _fail(self, row: int, turn: int | None, kind: str, detail: str) -> str:
        message = f"environment {self._where(row, turn)}: {kind}: {detail}"
        if self.failure != "abort":
            raise EnvironmentFailure(message, kind)
        return message

    async def _guarded(self, row: int, turn: int | None, call: Callable[[], Any]) -> tuple[Any, str]:
        """``await call()`` for row ``row``: on the caller's loop under ``failure="raise"``, else
        on the row's worker thread under the time limit; ``(result, "")`` or ``(None, failure
        message)``. A call that failed retires its worker (the trajectory ends there)."""
        if self.failure == "raise":  # the task's environment: its errors are the run's
            try:
                return await call(), ""
            except ToolCallParseFailed as exc:
                raise exc.__cause__ from None
        try:
            return await self.workers[row].call(call, self.timeout_s), ""
        except asyncio.TimeoutError:
            kind, detail = "timeout", f"no answer within --env-timeout-seconds {self.timeout_s:g}"
        except asyncio.CancelledError:
            raise
        except ToolCallParseFailed as exc:
            kind, detail = "raised", f"parse_tool_calls: {_error_text(exc.__cause__)}"
        except Exception as exc:  # the environment's own error, kept in the message
            kind, detail = "raised", _error_text(exc)
        self.workers[row].close()  # a blocked call strands it; env_worker bounds those
        return None, self._fail(row, turn, kind, detail)

    def close(self) -> None:
        """Let every row's worker thread go (at once for an idle one; a blocked one ends when
        its call returns, :mod:`replayrl.rollout.episodes.env_worker`). Never blocks;
        idempotent. :func:`replayrl.rollout.episodes.turn_loop.run_episodes` calls it when the
        batch's loop ends, however it ends."""
        for worker in self.workers:
            if worker is not None:
                worker.close()

    def _text_limit(self, room: int | None) -> int | None:
        """The most characters a text can have and still tokenise to ``room`` ids or fewer
        (``None``: no bound known)."""
        if room is None or self.tokenizer is None:
            return None
        per = chars_per_token(self.tokenizer)
        return None if per is None else max(int(room), 0) * per

    async def start(self, max_prompt_len: int | None = None) -> None:
        """Build and reset every row's environment (concurrently). A row whose environment
        cannot be built or reset, or whose reset returns something but ``None`` or a
        :class:`Reset` with no tools or the class's ``tools`` (the schema every prompt was
        rendered with), or an opening observation that is neither text nor a sequence of
        ``{"role": str, "content": str}`` messages (or text that is not valid Unicode), is
        failed; its first turn ends it (:meth:`respond`). A reset's opening observation is
        rendered into the row's prompt ids (:attr:`openings`, ``PromptTokenizer.render_opening``).

        Args:
            max_prompt_len: the most ids a prompt with its opening may have (the positions less
                one turn's tokens); an opening whose text cannot fit is failed
                (``observation_too_long``) before it is tokenised. ``None``: no bound here
                (the turn loop checks the rendered length).
        Raises:
            EnvironmentFailure: under ``failure="error"`` (``"raise"``: a malformed reset);
                ``"stranded"``: too many earlier calls never returned
                (:func:`replayrl.rollout.episodes.env_worker.check_stranded`), whatever
                ``failure`` says.
            Whatever the environment raises, under ``failure="raise"``.
            replayrl.rollout.errors.ChatTemplateError: the opening cannot be rendered into the
                prompt (the run's template, not the environment).
            TurnLoopError: an opening observation, and no tokenizer to render it.
        """
        if self.failure != "raise":
            check_stranded(self.name)
            self.workers = [EnvWorker() for _ in self.prompts]

        async def one(row: int) -> None:
            async def build_and_reset():
                env = self.make_env()
                self.envs[row] = env
                return await env.reset(self.prompts[row])
            reset, self.failed[row] = await self._guarded(row, None, build_and_reset)
            if self.failed[row] or reset is None:
                return
            env = self.envs[row]
            if not isinstance(reset, Reset):
                self.failed[row] = self._fail(row, None, "malformed", f"reset() returned "
                                              f"{type(reset).__name__}, not a Reset or None")
            elif reset.tools and tuple(map(dict, reset.tools)) != tuple(map(dict, env.tools)):
                self.failed[row] = self._fail(
                    row, None, "malformed", f"reset() offers tools other than "
                    f"{type(env).__name__}.tools, which the prompts were rendered with")
            elif reset.observation is not None:
                malformed = _check_opening(reset.observation)
                opening = ([reset.observation] if isinstance(reset.observation, str)
                           else [m["content"] for m in reset.observation] if not malformed else [])
                chars = sum(map(len, opening))
                limit = self._text_limit(None if max_prompt_len is None
                                         else max_prompt_len - len(self.prompts[row].prompt_ids))
                if malformed:
                    self.failed[row] = self._fail(row, None, "malformed", malformed)
                elif limit is not None and chars > limit:
                    self.failed[row] = self._fail(
                        row, None, "observation_too_long",
                        f"the opening observation is {chars} characters, more than the "
                        f"{limit} the {max(max_prompt_len, 0)} prompt positions can hold")
                elif self.tokenizer is None:
                    raise TurnLoopError(f"row {row}: an opening observation needs the sessions' "
                                        "tokenizer (EnvSessions(tokenizer=None))")
                else:
                    self.openings[row] = self.tokenizer.render_opening(
                        reset.observation, self.prompts[row].prompt_ids, sample_id=row)

        await asyncio.gather(*(one(row) for row in range(len(self.prompts))))

    def too_long(self, row: int, turn: int, length: int, left: int, max_positions: int) -> str:
        """The failure of an observation of ``length`` ids after turn ``turn`` of row ``row``
        when the context has ``left`` positions for it (of ``max_positions``): a failure message
        (``observation_too_long``), raised under ``failure="error"``; ``""`` under
        ``failure="raise"``, where such a trajectory ends with ``"length"``."""
        if self.failure == "raise":
            return ""
        return self._fail(row, turn, "observation_too_long",
                          f"the observation is {length} tokens, longer than the {max(left, 0)} "
                          f"positions the context has left ({max_positions} in all)")

    def fail_opening(self, row: int, detail: str) -> None:
        """Fail a row whose opening observation does not fit the context (found by the turn
        loop): its opening is dropped and its first turn ends it (:meth:`respond`).

        Raises:
            EnvironmentFailure: under ``failure="error"`` / ``"raise"``.
        """
        self.openings[row] = None
        self.failed[row] = self._fail(row, None, "observation_too_long", detail)

    async def respond(self, row: int, turn: int, generation: Any,
                      room: int | None = None) -> Answer:
        """The environment's answer to turn ``turn`` of row ``row``.

        Args:
            generation: the turn's :class:`replayrl.rollout.engines.base.Generation`.
            room: the positions the context has left for the observation (``None``: unknown).
                An ``--env`` observation that cannot fit -- more ids than ``room``, or text
                longer than ``room`` tokens can spell (:func:`chars_per_token`) -- is failed
                (``observation_too_long``) before it is rendered, so a giant observation costs
                no tokenisation. The task's own environment (``failure="raise"``) is left to
                the turn loop's ``"length"``.
        Returns:
            an :class:`Answer`; ``failure`` set when the environment raised, timed out, gave a
            malformed step (not a :class:`Step`; text that is not valid Unicode; token ids
            outside the tokenizer's ``[0, vocab_size)``) or an observation that cannot fit, or
            its reset failed.
        Raises:
            EnvironmentFailure: under ``failure="error"`` (``"raise"``: a malformed step).
            Whatever the environment's ``parse_tool_calls`` / ``step`` raise, under
                ``failure="raise"`` (the digit calculator: ``ToolEnvError``).
            replayrl.rollout.errors.ChatTemplateError, TokenizerError: the observation cannot be
                rendered (the run's template, not the environment).
            TurnLoopError: a text observation, and no tokenizer to render it.
        """
        if self.failed[row]:
            return Answer(None, 0.0, self.failed[row])
        env = self.envs[row]
        ids = np.asarray(generation.response_ids)
        text = "" if self.tokenizer is None else turn_text(self.tokenizer, ids)

        async def parse_and_step():
            try:
                calls = env.parse_tool_calls(text)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # sys.exit() included: named as the parser's
                raise ToolCallParseFailed() from exc
            self.parse_errors[row] += sum(1 for call in calls if getattr(call, "error", ""))
            return await env.step(Turn(turn, ids, text, tuple(calls), generation.finish_reason))

        step, failure = await self._guarded(row, turn, parse_and_step)
        if failure:
            return Answer(None, 0.0, failure)
        malformed = check_step(step)
        if not malformed and self.failure != "raise":
            malformed = self._check_observation(step.observation)
        if malformed:
            return Answer(None, 0.0, self._fail(row, turn, "malformed", malformed))
        if step.done or step.observation is None:
            return Answer(None, float(step.reward))
        if self.failure != "raise" and room is not None:
            too_long = self._too_long_before_rendering(step.observation, room)
            if too_long:
                return Answer(None, 0.0, self._fail(row, turn, "observation_too_long", too_long))
        if self.tokenizer is None:
            if isinstance(step.observation, str):
                raise TurnLoopError(f"row {row}, turn {turn}: a text observation needs the "
                                    "sessions' tokenizer (EnvSessions(tokenizer=None))")
            return Answer(np.asarray(step.observation, np.int32), float(step.reward))
        if isinstance(step.observation, str):
            obs = self.tokenizer.render_tool_text(step.observation, ids, sample_id=row)
        else:
            obs = self.tokenizer.render_observation(np.asarray(step.observation, np.int32), ids,
                                                    sample_id=row)
        return Answer(obs, float(step.reward))

    def _check_observation(self, observation: Any) -> str:
        """Why an ``--env`` step's observation cannot be rendered (``""`` when it can): text
        that is not valid Unicode, or token ids outside ``[0, vocab_size)``."""
        if observation is None:
            return ""
        if isinstance(observation, str):
            return _not_utf8(observation)
        arr = np.asarray(observation)
        high = None if self.tokenizer is None else self.tokenizer.vocab_size
        if arr.size and (int(arr.min()) < 0 or (high is not None and int(arr.max()) >= high)):
            return (f"observation ids span [{int(arr.min())}, {int(arr.max())}], outside the "
                    f"tokenizer's [0, {high if high is not None else INT32_MAX + 1})")
        if arr.size and int(arr.max()) > INT32_MAX:
            return f"observation id {int(arr.max())} does not fit int32"
        return ""

    def _too_long_before_rendering(self, observation: Any, room: int) -> str:
        """Why an observation cannot fit ``room`` positions, judged by its size alone (``""``
        when it may)."""
        if isinstance(observation, str):
            limit = self._text_limit(room)
            if limit is not None and len(observation) > limit:
                return (f"the observation is {len(observation)} characters, more than the "
                        f"{limit} the {max(room, 0)} positions the context has left can hold")
            return ""
        if len(observation) > max(room, 0):
            return (f"the observation is {len(observation)} tokens, longer than the "
                    f"{max(room, 0)} positions the context has left")
        return ""
