"""Built-in rewards (``--rm-type``) and the guard every reward call runs under.

* ``digits``: the embedded task's verifier on the final segment
  (:meth:`replayrl.rollout.tasks.calculator.DigitToolEnv.reward`), the default;
* ``exact``: 1.0 when the response text equals the label after :func:`normalise`, else 0.0;
* ``math``: 1.0 when the response's final answer (a ``\\boxed{}`` answer first, else the last
  expression) is mathematically equivalent to the label, checked by Hugging Face's
  ``math-verify`` (optional extra ``math``), else 0.0.

Text rewards read the *final segment* (the tokens after the last observation) decoded with
special tokens left out. A reward that raises or runs over ``--reward-timeout-seconds`` is a
:class:`RewardFailure` naming the sample, or, with ``--reward-failure zero``, a counted 0
(docs/design/prompt-data.md#prompt-data).
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable

from replayrl.rollout.errors import RewardError, RewardFailure

__all__ = ["normalise", "exact_reward", "math_reward", "load_math_verify", "RewardCall",
           "RewardGuard"]


_SPACES = re.compile(r"\s+")


def normalise(text: str) -> str:
    """``text`` for comparison: Unicode NFKC, case-folded, whitespace runs as one space, stripped."""
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def exact_reward(response_text: str, label: str) -> float:
    """1.0 when ``normalise(response_text) == normalise(label)``, else 0.0."""
    return 1.0 if normalise(response_text) == normalise(label) else 0.0


def load_math_verify() -> tuple[Callable, Callable]:
    """``(parse, verify)`` of the ``math-verify`` package.

    Raises:
        RewardError: the package is not installed (names the extra to install).
    """
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise RewardError("--rm-type math needs the math-verify package: "
                          "pip install 'replayrl[math]'") from exc
    # it warns on every call that its own timeouts are off; RewardGuard enforces the limit
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return parse, verify


def math_reward(response_text: str, label: str) -> float:
    """1.0 when math-verify finds the response's answer equivalent to ``label``, else 0.0.

    The label is parsed as an answer (a bare ``1/2`` is wrapped in ``$...$`` so the LaTeX parser
    reads it); the response is parsed whole, where math-verify prefers a ``\\boxed{}`` answer.
    math-verify's own signal-based timeouts are off (they work only on the main thread); the
    call runs under :class:`RewardGuard`'s limit instead.

    Raises:
        RewardError: math-verify is not installed.
    """
    parse, verify = load_math_verify()
    gold_text = label if "$" in label or "\\boxed" in label else f"${label}$"
    gold = parse(gold_text, parsing_timeout=None)
    answer = parse(response_text, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


@dataclass(frozen=True)
class RewardCall:
    """One reward computation, as a task states it (``replayrl.rollout.tasks.base.Task.reward``)
    for :meth:`RewardGuard.run`.

    Attributes:
        fn: the verifier; ``fn(*args)`` returns the reward, a finite float.
        args: its arguments (read-only arrays, text, labels).
        bounded: the work is bounded by the response length (a token or string comparison):
            it runs inline on the caller's thread (:meth:`RewardGuard.score_inline`); otherwise
            on a thread of its own under the time limit (:meth:`RewardGuard.score`).
    """

    fn: Callable[..., Any]
    args: tuple
    bounded: bool = False


class RewardGuard:
    """Runs each reward call on its own daemon thread with a time limit.

    A call that raises or does not return within ``timeout_s`` becomes a :class:`RewardFailure`
    naming the sample (``failure == "error"``) or a reward of 0.0 counted in :attr:`failures`
    (``failure == "zero"``); the run never waits longer than the limit on one call. A Python
    thread cannot be killed, so a call that never returns keeps its thread; the thread is a
    daemon, so it does not hold the process open at exit.

    Args:
        timeout_s: seconds one call may take (> 0).
        failure: ``"error"`` or ``"zero"``.
    """

    def __init__(self, timeout_s: float, failure: str) -> None:
        if failure not in ("error", "zero"):
            raise RewardError(f"--reward-failure must be error or zero, got {failure!r}")
        self.timeout_s = float(timeout_s)
        self.failure = failure
        self.failures = 0

    async def score(self, sample: str, fn: Callable[..., Any], *args: Any) -> float:
        """``float(fn(*args))`` within the time limit.

        Args:
            sample: how errors name the trajectory (e.g. ``"sample 17 (prompt file.jsonl:3)"``).
        Returns:
            the reward, a finite float (0.0 for a failure under ``"zero"``).
        Raises:
            RewardFailure: under ``"error"``, the call raised, ran over the limit or returned
                something that is not a finite number.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if not future.done():  # a timed-out call's late answer is dropped
                future.set_exception(error) if error is not None else future.set_result(value)

        def work() -> None:
            try:
                value, error = fn(*args), None
            except BaseException as exc:  # handed to the waiting coroutine, not lost
                value, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the loop closed while the call ran
                pass

        threading.Thread(target=work, name=f"reward {sample}", daemon=True).start()
        try:
            value = float(await asyncio.wait_for(future, self.timeout_s))
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"reward is not finite: {value}")
            return value
        except asyncio.TimeoutError:
            why = f"reward exceeded --reward-timeout-seconds {self.timeout_s:g}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            why = f"reward raised {type(exc).__name__}: {exc}"
        return self._failed(sample, why)

    def score_inline(self, sample: str, fn: Callable[..., Any], *args: Any) -> float:
        """``float(fn(*args))`` on the caller's thread, with :meth:`score`'s handling of a
        call that raises or returns a non-finite value, and no time limit: only for the
        built-in rewards whose work is bounded by the response length (``--rm-type digits`` /
        ``exact``), where a thread per call would cost more than the reward (128 calls a step).

        Raises:
            RewardFailure: as :meth:`score`.
        """
        try:
            value = float(fn(*args))
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"reward is not finite: {value}")
            return value
        except Exception as exc:
            return self._failed(sample, f"reward raised {type(exc).__name__}: {exc}")

    async def run(self, sample: str, call: RewardCall) -> float:
        """:meth:`score_inline` of a bounded ``call``, else :meth:`score`.

        Raises:
            RewardFailure: as :meth:`score`.
        """
        if call.bounded:
            return self.score_inline(sample, call.fn, *call.args)
        return await self.score(sample, call.fn, *call.args)

    def _failed(self, sample: str, why: str) -> float:
        if self.failure == "error":
            raise RewardFailure(f"{sample}: {why} (--reward-failure zero scores it 0)")
        self.failures += 1
        return 0.0
