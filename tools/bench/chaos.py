"""``replayrl bench faults --chaos SECONDS``: the chaos soak, a random engine SIGKILLed about
every SECONDS while a real run trains, and what every step trained.

The run is ``replayrl train`` with the flags after ``--`` (any mode: ``--train-backend fsdp
--dp-size 2``, ``--hf-checkpoint`` of a family, ``--env`` with ``--rollout-max-turns``,
``--dynamic-sampling``) over :data:`CHAOS_FLAGS` (two engines that are restarted when lost, so a
killed engine always has a peer and comes back), in this process (``launch``). Beside it, a task
picks one of the run's live engine processes (this process's children whose ``comm`` is
``rrl:engine_*``, :data:`replayrl.actors.process_title.COMM_PREFIX`) at random after a wait drawn
uniformly from 0.5 to 1.5 x SECONDS and sends it SIGKILL, until the run ends.

:func:`check_rows` then reads the run's metrics rows: the steps trained, the prompt groups each
step trained against ``--rollout-batch-size`` (``trained_groups``) and its samples against
groups x ``--n-samples-per-prompt``, the largest ``staleness_max`` against ``--max-staleness``, the
groups generated again (``groups_regenerated``), the trajectories of a multi-turn ``--env`` run
generated again after a lapsed version pin (``episodes_regenerated``) and the fewest engines
alive.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import time
from pathlib import Path
from typing import Sequence

from replayrl.actors.process_title import COMM_PREFIX
from replayrl.tools.errors import ConfigError

CHAOS_FLAGS = {"num-engines": 2, "engine-failure": "restart"}
"""Flags the soak sets over the run's own (a run's flags may raise ``--num-engines``)."""

ENGINE_COMM = COMM_PREFIX + "engine_"
"""The ``comm`` name prefix of an engine actor's process."""


def engine_pids(parent: int | None = None) -> dict[str, int]:
    """The live engine processes among ``parent``'s children (default: this process): their
    ``comm`` name (``rrl:engine_0``) -> pid. Zombies (exited, not yet reaped) are left out."""
    parent = os.getpid() if parent is None else parent
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # it exited while we looked
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        state, ppid = rest.split()[:2]
        if int(ppid) == parent and name.startswith(ENGINE_COMM) and state not in "ZX":
            found[name] = int(entry)
    return found


async def kill_engines(every_s: float, rng: random.Random, kills: list[dict],
                       armed: Path) -> None:
    """Once the file ``armed`` holds a byte (the run's ``metrics.jsonl`` its first row: losses
    while the run starts end it, by design), forever: wait ``every_s`` x U(0.5, 1.5) seconds,
    then SIGKILL one live engine process (:func:`engine_pids`) chosen by ``rng``; each kill is
    appended to ``kills`` as ``{"engine", "pid", "time"}`` (wall-clock seconds). A wait that finds
    no live engine kills nothing. Cancel it to stop."""
    while not (armed.exists() and armed.stat().st_size):
        await asyncio.sleep(0.2)
    while True:
        await asyncio.sleep(every_s * rng.uniform(0.5, 1.5))
        pids = engine_pids()
        if not pids:
            continue
        name = rng.choice(sorted(pids))
        try:
            os.kill(pids[name], signal.SIGKILL)
        except ProcessLookupError:  # it exited between the scan and the kill
            continue
        kills.append({"engine": name.removeprefix(COMM_PREFIX), "pid": pids[name],
                      "time": time.time()})


def check_rows(rows: Sequence[dict], groups: int, n: int, max_staleness: int) -> dict:
    """What a run's metrics ``rows`` trained against its settings.

    Args:
        rows: ``metrics.jsonl`` rows, one per step.
        groups: ``--rollout-batch-size``, the prompt groups every step must train.
        n: ``--n-samples-per-prompt``.
        max_staleness: ``--max-staleness``.
    Returns:
        ``{"steps", "groups_per_step" (the distinct ``trained_groups`` values), "samples_lost",
        "samples_duplicated" (summed over steps against groups x n), "staleness_max",
        "groups_regenerated", "episodes_regenerated", "engines_alive_min", "ok"}``; ``ok``
        holds when every step trained ``groups`` groups and ``groups x n`` samples at a staleness
        of at most ``max_staleness``.
    """
    expected = groups * n
    trained = sorted({r["trained_groups"] for r in rows})
    lost = sum(max(0, expected - r["samples"]) for r in rows)
    duplicated = sum(max(0, r["samples"] - expected) for r in rows)
    staleness = max((r["staleness_max"] for r in rows), default=0)
    out = {"steps": len(rows), "groups_per_step": trained, "samples_lost": lost,
           "samples_duplicated": duplicated, "staleness_max": staleness,
           "groups_regenerated": sum(r.get("groups_regenerated", 0) for r in rows),
           "episodes_regenerated": sum(r.get("episodes_regenerated", 0) for r in rows),
           "engines_alive_min": min((r.get("engines_alive", 0) for r in rows), default=0)}
    out["ok"] = (trained == [groups] and lost == 0 and duplicated == 0
                 and staleness <= max_staleness)
    return out


class _TrainFlags(argparse.ArgumentParser):
    """``replayrl train``'s flags whose error is a :class:`ConfigError` (one line), not a usage."""

    def error(self, message: str):
        raise ConfigError(f"the run's flags (after --): {message}")


def chaos_config(train_argv: Sequence[str], output: Path):
    """The :class:`replayrl.tools.run.config.RunConfig` of ``replayrl train`` with
    ``train_argv`` over :data:`CHAOS_FLAGS`, ``--no-progress`` and ``--output-dir output``.

    Raises:
        ConfigError: a flag ``replayrl train`` does not know, or a value the run refuses.
    """
    from replayrl.tools.run.flags import add_run_flags
    from replayrl.tools.run.from_flags import config_from_args

    parser = _TrainFlags(prog="replayrl train", add_help=False)
    add_run_flags(parser)
    defaults = [f"--{k}={v}" for k, v in CHAOS_FLAGS.items()]
    args = parser.parse_args([*defaults, "--no-progress", *train_argv,
                              "--output-dir", str(output)])
    return config_from_args(args)


async def soak(config, every_s: float, seed: int) -> dict:
    """One run of ``config`` (:func:`chaos_config`) with an engine killed about every
    ``every_s`` seconds from its first step's row on (:func:`kill_engines`, drawn from
    ``seed``).

    Returns:
        :func:`check_rows` of its rows, plus ``"kills"`` and ``"seconds"`` (the run's wall clock).
    Raises:
        whatever the run raised (``ActorDied`` for a loss the run does not survive).
    """
    from replayrl.tools.run.launcher import launch

    output = Path(config.output_dir)
    kills: list[dict] = []
    killer = asyncio.ensure_future(kill_engines(every_s, random.Random(seed), kills,
                                                 output / "metrics.jsonl"))
    started = time.perf_counter()
    try:
        result = await launch(config)
    finally:
        killer.cancel()
        await asyncio.gather(killer, return_exceptions=True)
    report = check_rows(result.rows, config.rollout.rollout_batch_size,
                        config.rollout.n_samples_per_prompt, config.max_staleness)
    return {**report, "kills": len(kills), "seconds": time.perf_counter() - started}


def row(flags: Sequence[str], report: dict) -> str:
    """One markdown table row of a :func:`soak` report of the run with ``flags`` (columns of
    :data:`HEADER`)."""
    return (f"| {' '.join(flags) or '(defaults)'} | {report['steps']} | {report['seconds']:.0f} s "
            f"| {report['kills']} | {report['groups_regenerated']} / "
            f"{report['episodes_regenerated']} | {report['engines_alive_min']} | "
            f"{report['staleness_max']} | {' '.join(map(str, report['groups_per_step']))} | "
            f"{report['samples_lost']} / {report['samples_duplicated']} | {'yes' if report['ok'] else 'NO'} |")


HEADER = ("| run flags | steps | seconds | engines killed | groups / episodes regenerated "
          "| fewest engines alive | staleness max | groups per step | samples lost / duplicated | "
          "every check |\n|---|---|---|---|---|---|---|---|---|---|")
"""The header of :func:`row`'s table."""
