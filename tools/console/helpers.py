"""The console helpers of ``replayrl repl`` that ask the run and show the answer: ``methods``,
``clock``, ``metrics``, ``sample``, ``pause`` and ``resume`` (docs/design/multi-host.md#attach-and-multi-host).
What they print is :mod:`replayrl.tools.console.views`'s.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from replayrl.tools.console.runs import CLOCK, MANAGER, AttachedRun, OwnRun
from replayrl.tools.console.views import Shown, methods_text, metrics_rows, metrics_text, sample_text
from replayrl.tools.errors import ReplError

__all__ = ["ConsoleHelpers"]


class ConsoleHelpers:
    """The helpers a session's console namespace offers, bound to one started session.

    Args:
        session: the :class:`replayrl.tools.console.repl.ReplSession` whose calls they make
            (``call``, ``interface``, ``names``, ``rows``, ``call_timeout``).
        run: the run it serves; an attached run supplies the metrics file and is told when
            this console paused generation (it resumes it on leaving).
    """

    def __init__(self, session: Any, run: OwnRun | AttachedRun) -> None:
        self._session = session
        self._run = run

    def methods(self, name: str | None = None, docs: bool = True) -> Shown:
        """Every actor's (or one actor's) methods: signature and the docstring's first paragraph.

        Returns:
            :class:`replayrl.tools.console.views.Shown`; ``.value`` maps actor name -> ActorInterface.
        Raises:
            replayrl.actors.UnknownActor: no actor named ``name``; as
                :meth:`replayrl.tools.console.repl.ReplSession.call` otherwise.
        """
        session = self._session
        names = [name] if name is not None else session.names()
        interfaces = {n: session.interface(n) for n in names}
        return Shown("\n".join(methods_text(i, docs) for i in interfaces.values()), interfaces)

    def clock(self) -> dict:
        """The version clock's state (``trainer_version``, ``engine_versions``,
        ``max_staleness``) plus ``generation``: the rollout manager's gate (``paused``,
        ``in_flight``, ``held`` engine requests)."""
        session = self._session
        state = session.call(CLOCK, "state", timeout=session.call_timeout)
        return {**state, "generation": session.call(MANAGER, "generation_status",
                                                    timeout=session.call_timeout)}

    def metrics(self, n: int = 5, keys: str | list[str] | None = None) -> Shown:
        """The last ``n`` metrics rows as a table of ``keys`` (one key as a ``str``, or a list;
        default :data:`replayrl.tools.console.views.METRIC_KEYS`): an attached run's ``metrics.jsonl``, or
        the rows :meth:`replayrl.tools.console.repl.ReplSession.step` returned in a session's own run.

        Returns:
            :class:`replayrl.tools.console.views.Shown`; ``.value`` is the list of rows (dicts).
        Raises:
            ReplError: attached by an address, so the driver's ``metrics.jsonl`` is elsewhere
                (attach by the run's output directory), or the file is unreadable.
            replayrl.tools.console.views.MetricKeyError: a key of ``keys`` is in none of the rows shown.
        """
        if isinstance(self._run, AttachedRun):
            target = self._run.target
            output = target.output_dir if target is not None else ""
            if not output:
                raise ReplError(f"attached by address ({self._run.attach}): metrics.jsonl is on the "
                                f"driver's host; attach by the run's output directory instead")
            try:
                rows = metrics_rows(Path(output) / "metrics.jsonl", n)
            except FileNotFoundError:
                rows = []  # the run has not finished its first step
            except (OSError, ValueError) as exc:
                raise ReplError(f"metrics: {exc}") from None
        else:
            rows = self._session.rows[-n:] if n >= 1 else []
        return Shown(metrics_text(rows, keys or None), rows)

    def sample(self, rows: int = 4) -> Shown:
        """The last sample the rollout manager scored, with its traces (first ``rows`` rows of
        each): ``RolloutManager.last_sample``.

        Returns:
            :class:`replayrl.tools.console.views.Shown`; ``.value`` is the sample's columns.
        """
        columns = self._session.call(MANAGER, "last_sample", timeout=self._session.call_timeout)
        return Shown(sample_text(columns, rows), columns)

    def pause(self, wait: bool = True) -> dict:
        """Pause generation (``RolloutManager.pause_generation``); returns the gate's state. An
        attached console that paused resumes on leaving."""
        state = self._session.call(MANAGER, "pause_generation", wait,
                                   timeout=None if wait else self._session.call_timeout)
        self._run.paused_here = True
        return state

    def resume(self) -> dict:
        """Resume generation (``RolloutManager.resume_generation``); returns the gate's state."""
        state = self._session.call(MANAGER, "resume_generation", timeout=self._session.call_timeout)
        self._run.paused_here = False
        return state
