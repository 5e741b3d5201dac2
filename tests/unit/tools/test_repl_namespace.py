"""The console namespace and helpers of ``replayrl repl`` on a stand-in session (no actors)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from replayrl.tools.console.helpers import ConsoleHelpers
from replayrl.tools.console.namespace import ConsoleProxy, build_namespace
from replayrl.tools.console.runs import AttachedRun
from replayrl.tools.errors import ReplError


class _Session:
    """What build_namespace and ConsoleHelpers ask of a session, recording calls."""

    def __init__(self, names, attach="", target=None):
        self._names = names
        self.attach = attach
        self.target = target
        self.config = object()
        self.call_timeout = 7.5
        self.rows = [{"step": 0}, {"step": 1}, {"step": 2}]
        self.calls = []

    def names(self):
        return list(self._names)

    def call(self, name, method, *args, timeout=None, **kwargs):
        self.calls.append((name, method, args, timeout))
        return {"paused": method == "pause_generation"}

    def tell(self, *args, **kwargs):
        pass

    def step(self, k):
        return {"step": k}

    def interface(self, name):
        raise ReplError("no interface in this stand-in")


def test_own_namespace_has_proxies_helpers_and_step():
    session = _Session(["trainer", "engine-0", "call"])
    run = SimpleNamespace(paused_here=False)
    ns = build_namespace(session, ConsoleHelpers(session, run))
    assert sorted(ns["actors"]) == ["call", "engine-0", "trainer"]
    assert isinstance(ns["trainer"], ConsoleProxy)
    assert "engine-0" not in ns  # not an identifier: only under actors
    assert ns["call"] == session.call  # a helper wins over an actor of the same name
    assert ns["step"] == session.step and ns["config"] is session.config
    assert "waits 7.5 s" in ns["help_text"] and "step(k)" in ns["help_text"]
    assert ns["metrics"](2).value == [{"step": 1}, {"step": 2}]
    assert repr(ns["trainer"]) == "<actor trainer; not answering>"


def test_attached_namespace_has_no_step_and_pause_is_remembered_for_the_detach():
    run = AttachedRun("tcp://127.0.0.1:1", None, ready_timeout=1.0)
    run.target = SimpleNamespace(output_dir="")
    session = _Session(["rollout_manager"], attach="tcp://127.0.0.1:1", target=run.target)
    ns = build_namespace(session, ConsoleHelpers(session, run))
    assert "step" not in ns and "steps nothing" in ns["help_text"]
    assert ns["pause"](wait=False) == {"paused": True} and run.paused_here
    assert session.calls[-1] == ("rollout_manager", "pause_generation", (False,), 7.5)
    ns["resume"]()
    assert not run.paused_here and session.calls[-1][1] == "resume_generation"
    with pytest.raises(ReplError, match="attached by address"):
        ns["metrics"]()
