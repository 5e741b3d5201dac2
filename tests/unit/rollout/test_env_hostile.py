"""Environments that misbehave (``--env``, rollout/episodes/env_sessions.py): a step that
blocks the thread (``time.sleep``), never returns, raises, answers the wrong type, invalid
text, ids outside the vocabulary or a giant observation ends its own trajectory with a
counted, named failure within the time limit, while the batch's other trajectories go on and
the caller's event loop keeps running; threads of calls that never return are bounded.
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time

import numpy as np
import pytest

from replayrl.rollout.episodes import env_worker
from replayrl.rollout.episodes.env_sessions import EnvSessions
from replayrl.rollout.errors import EnvironmentFailure
from replayrl.rollout.tasks.environment import Reset, Step, ToolEnvironment
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.text.tokenizer import load_tokenizer
from tests.unit.rollout.test_env_interface import TOOLS_TEMPLATE, _call, _episodes, _prompt
from tests.unit.rollout.test_turn_separator import _gen, _make_tokenizer

CALL = _call("f")
RELEASE = threading.Event()  # set at the end of the module: no thread outlives it for long


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return _make_tokenizer(tmp_path_factory.mktemp("tools"), "qwen_tools", TOOLS_TEMPLATE,
                           ["<|im_start|>", "<|im_end|>"], "<|im_end|>")


@pytest.fixture(autouse=True, scope="module")
def _release_blocked_threads():
    yield
    RELEASE.set()


def _one_bad(bad_step=None, bad_reset=None, bad_parse=None):
    """Row 1 (prompt index 1) misbehaves as told; row 0 answers its call with "ok", then its
    final answer ends it."""
    class OneBad(ToolEnvironment):
        async def reset(self, prompt):
            self.bad = prompt.index == 1
            if self.bad and bad_reset is not None:
                return bad_reset()
            return None

        def parse_tool_calls(self, text):
            if self.bad and bad_parse is not None:
                bad_parse()
            return super().parse_tool_calls(text)

        async def step(self, turn):
            if self.bad and bad_step is not None:
                return bad_step()
            return Step(observation="ok") if turn.tool_calls else Step(done=True)
    return OneBad


def _blocks(seconds):
    def block():
        RELEASE.wait(seconds)  # blocks the thread as time.sleep does (and ends with the module)
        return Step(observation="late")
    return block


async def _run(tokdir, env_cls, *, timeout=0.3, failure="abort", tok=None):
    tok = tok or load_tokenizer(tokdir, apply_chat_template=True)
    prompts = [_prompt(tok, "good?", 0), _prompt(tok, "bad?", 1)]
    return await asyncio.wait_for(_episodes(tok, env_cls, prompts, [[CALL, "done"], [CALL, "x"]],
                                            timeout=timeout, failure=failure, max_positions=400), 30)


async def test_a_blocking_step_is_timed_out_while_the_loop_and_the_others_go_on(tokdir):
    sleeper = []

    def sleeps():
        sleeper.append(threading.current_thread())
        time.sleep(3.0)  # the mistake: blocking code in an async step
        return Step(observation="late")

    ticks = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    tok = load_tokenizer(tokdir, apply_chat_template=True)
    tick = asyncio.ensure_future(ticker())
    started = time.monotonic()
    (good, bad), _ = await _run(tokdir, _one_bad(sleeps), timeout=0.3, tok=tok)
    elapsed = time.monotonic() - started
    tick.cancel()
    assert bad.finish_reason == "env_error" and "(row 1), turn 0: timeout: no answer within " \
        "--env-timeout-seconds 0.3" in bad.failure
    assert good.finish_reason == "stop" and good.num_tool_calls == 1 and good.failure == ""
    # the blocked step's 3 s never stalled the loop: the run ended before it returned (0.4 s
    # here), and the loop kept ticking (gaps of 0.03 s here; a blocked loop shows 3 s)
    assert elapsed < 2.5
    assert max(np.diff(ticks)) < 1.0
    # its stranded thread returns within this test, not during a later one that counts them
    await asyncio.to_thread(sleeper[0].join, 10)
    assert not sleeper[0].is_alive()


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def _raises_unprintable():
    raise Unprintable()


def _raise(exc):
    raise exc


HOSTILE = {
    "never returns": (dict(bad_step=_blocks(3600)), "timeout", "no answer within"),
    "parse blocks": (dict(bad_parse=lambda: RELEASE.wait(3600)), "timeout", "no answer within"),
    "reset blocks": (dict(bad_reset=_blocks(3600)), "timeout", "no answer within"),
    "raises": (dict(bad_step=lambda: 1 / 0), "raised", "ZeroDivisionError: division by zero"),
    "parse raises": (dict(bad_parse=lambda: {}["k"]), "raised", "parse_tool_calls: KeyError"),
    "returns None": (dict(bad_step=lambda: None), "malformed", "step() returned NoneType"),
    "wrong observation": (dict(bad_step=lambda: Step(observation={"a": 1})), "malformed",
                          "observation is dict"),
    "nan reward": (dict(bad_step=lambda: Step("ok", reward=float("nan"))), "malformed",
                   "reward nan is not a finite number"),
    "invalid text": (dict(bad_step=lambda: Step(observation="ok \udcff")), "malformed",
                     "not valid Unicode"),
    "ids past the vocabulary": (dict(bad_step=lambda: Step(observation=[5, 10 ** 6])), "malformed",
                                "outside the tokenizer's [0, "),
    "negative ids": (dict(bad_step=lambda: Step(observation=np.array([-1], np.int64))),
                     "malformed", "observation ids span [-1, -1]"),
    "giant int reward": (dict(bad_step=lambda: Step("ok", reward=10 ** 5000)), "malformed",
                         "reward <int> is not a finite number"),
    "ragged ids": (dict(bad_step=lambda: Step(observation=[1, [2, 3]])), "malformed",
                   "observation is list, not text or a 1-d array of token ids"),
    "done not a bool": (dict(bad_step=lambda: Step("ok", done="yes" * 10 ** 6)), "malformed",
                        "done 'yesyes"),
    "unprintable error": (dict(bad_step=_raises_unprintable), "raised",
                          "Unprintable: <unprintable>"),
    "giant error": (dict(bad_step=lambda: _raise(RuntimeError("x" * 10 ** 7))), "raised",
                    "RuntimeError: xxx"),
    "exits": (dict(bad_step=lambda: sys.exit(3)), "raised", "SystemExit: 3"),
    "parse exits": (dict(bad_parse=lambda: sys.exit("bye")), "raised",
                    "parse_tool_calls: SystemExit: bye"),
    "giant text": (dict(bad_step=lambda: Step(observation="z" * 50_000_000)),
                   "observation_too_long", "the observation is 50000000 characters"),
    "giant ids": (dict(bad_step=lambda: Step(observation=np.ones(10_000_000, np.int32))),
                  "observation_too_long", "the observation is 10000000 tokens"),
    "giant opening": (dict(bad_reset=lambda: Reset(observation="z" * 50_000_000)),
                      "observation_too_long", "the opening observation is 50000000 characters"),
    "invalid opening": (dict(bad_reset=lambda: Reset(observation=[{"role": "system",
                                                                   "content": "\ud800"}])),
                        "malformed", "not valid Unicode"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_a_hostile_environment_ends_its_own_trajectory_with_a_named_failure(tokdir, case):
    behaviour, kind, detail = HOSTILE[case]
    started = time.process_time()
    # a short limit only where the case is a hang: the others must fail by their kind even on a
    # loaded machine, where building a 10 M-id observation alone can take longer than 0.3 s
    (good, bad), _ = await _run(tokdir, _one_bad(**behaviour), timeout=0.3 if kind == "timeout" else 10.0)
    # within the time limit and without tokenising a giant observation (50 M characters
    # would take minutes): the CPU spent is the test's own set-up
    assert time.process_time() - started < 3.0
    assert bad.finish_reason == "env_error" and len(bad.turns) == 1
    at = "reset" if case.startswith(("reset", "giant opening", "invalid opening")) else "turn 0"
    assert bad.failure.startswith(f"environment test-env at prompt prompts.jsonl:2 (row 1), "
                                  f"{at}: {kind}: "), bad.failure
    assert detail in bad.failure and len(bad.failure) < 2300  # a giant message is cut
    assert good.finish_reason == "stop" and good.num_tool_calls == 1 and good.failure == ""


async def test_under_env_failure_error_a_blocking_step_ends_the_run_naming_it(tokdir):
    with pytest.raises(EnvironmentFailure, match=r"\(row 1\), turn 0: timeout") as info:
        await _run(tokdir, _one_bad(_blocks(3600)), failure="error")
    assert info.value.kind == "timeout"


async def test_threads_of_calls_that_never_return_are_bounded(tokdir, monkeypatch):
    gate = threading.Event()

    def waits():
        gate.wait(30)
        return Step(observation="late")

    base = env_worker.stranded()
    monkeypatch.setattr(env_worker, "MAX_STRANDED", base + 1)
    tok = load_tokenizer(tokdir, apply_chat_template=True)
    (good, bad), _ = await _run(tokdir, _one_bad(waits))
    assert bad.failure and env_worker.stranded() == base + 1  # the blocked row's thread
    sessions = EnvSessions(lambda: _one_bad()(None), [_prompt(tok, "q", 0)], tokenizer=tok,
                           timeout_s=1.0, name="test-env")
    with pytest.raises(EnvironmentFailure, match=r"environment test-env: \d+ calls past "
                                                 r"--env-timeout-seconds have not returned") as info:
        await sessions.start()  # any failure mode: the run ends rather than pile threads up
    assert info.value.kind == "stranded"
    gate.set()  # the call returns: its thread ends and is no longer counted
    deadline = time.monotonic() + 5
    while env_worker.stranded() > base and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert env_worker.stranded() == base


async def test_an_environment_runs_on_a_daemon_thread_of_its_own_and_idle_ones_end():
    seen = []

    class Where(ToolEnvironment):
        def __init__(self, config=None):
            super().__init__(config)
            seen.append(("init", threading.current_thread()))

        async def step(self, turn):
            seen.append(("step", threading.current_thread()))
            return Step(done=True)

    prompts = [Prompt(i, np.array([1, 2], np.int32), -1, "") for i in range(2)]
    sessions = EnvSessions(Where, prompts, tokenizer=None, timeout_s=5.0)
    await sessions.start()
    gen = _gen([3], "stop")
    await asyncio.gather(*(sessions.respond(row, 0, gen) for row in range(2)))
    threads = {row: [t for what, t in seen if sessions.workers[row].thread is t]
               for row in range(2)}
    assert all(len(ts) == 2 for ts in threads.values())  # init and step, each on its row's
    assert threads[0][0] is not threads[1][0] and threading.main_thread() not in {t for _, t in seen}
    assert all(w.thread.daemon for w in sessions.workers)  # never keeps the process alive
    sessions.close()
    for worker in sessions.workers:
        worker.thread.join(5)
        assert not worker.thread.is_alive()
