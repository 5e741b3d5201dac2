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
alive. For a long soak, :func:`sample_usage` samples every process's RSS and open descriptors
every N steps (:mod:`replayrl.tools.bench.proc_usage` says which stayed flat), and a time budget
stops the run and reports the steps it trained by then.
"""
from __future__ import annotations

import argparse
import asyncio
import json
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


async def sample_usage(metrics: Path, every: int, samples: list[dict],
                       out: Path | None = None, poll_s: float = 0.5) -> None:
    """Forever: each time the run's ``metrics`` file has reached another multiple of ``every``
    rows (steps), append :func:`replayrl.tools.bench.proc_usage.sample_tree` of this process's
    tree at that step count to ``samples`` (and as a json line to ``out``). Polls every
    ``poll_s`` seconds, so a sample's step is the row count when it was taken (at or just past
    the multiple). Cancel it to stop."""
    from replayrl.tools.bench.proc_usage import append_sample, sample_tree

    next_step, steps, offset = every, 0, 0
    while True:
        await asyncio.sleep(poll_s)
        try:
            with metrics.open("rb") as f:  # only the bytes written since the last poll
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            continue
        offset += chunk.rfind(b"\n") + 1
        steps += chunk.count(b"\n")
        if steps >= next_step:
            samples.append(sample_tree(os.getpid(), steps))
            if out is not None:
                append_sample(out, samples[-1])
            next_step = (steps // every + 1) * every


def read_rows(path: Path) -> list[dict]:
    """The complete json rows of a metrics file (a line cut by a stop is left out)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


async def soak(config, every_s: float, seed: int, usage_every: int = 0,
               usage_out: Path | None = None, budget_s: float | None = None) -> dict:
    """One run of ``config`` (:func:`chaos_config`) with an engine killed about every
    ``every_s`` seconds from its first step's row on (:func:`kill_engines`, drawn from
    ``seed``).

    Args:
        usage_every: above 0, sample every process's RSS and open fds every that many steps
            (:func:`sample_usage`); one more sample is taken when the budget stops the run.
        usage_out: a jsonl file the samples are also appended to.
        budget_s: stop the run (cancel it: every actor stopped) after that many seconds, and
            report the steps its ``metrics.jsonl`` holds by then.
    Returns:
        :func:`check_rows` of its rows, plus ``"kills"``, ``"seconds"`` (the run's wall clock),
        ``"stopped_by_budget"`` and ``"usage"`` (the samples, in step order).
    Raises:
        whatever the run raised (``ActorDied`` for a loss the run does not survive).
    """
    from replayrl.tools.bench.proc_usage import append_sample, sample_tree
    from replayrl.tools.run.launcher import launch

    output = Path(config.output_dir)
    metrics = output / "metrics.jsonl"
    kills: list[dict] = []
    samples: list[dict] = []
    helpers = [asyncio.ensure_future(kill_engines(every_s, random.Random(seed), kills, metrics))]
    if usage_every > 0:
        helpers.append(asyncio.ensure_future(sample_usage(metrics, usage_every, samples,
                                                          usage_out)))
    started = time.perf_counter()
    run = asyncio.ensure_future(launch(config))
    stopped = False
    try:
        await asyncio.wait({run}, timeout=budget_s)
        if not run.done():  # the budget is spent: a last sample while every actor still runs
            stopped = True
            if usage_every > 0:
                samples.append(sample_tree(os.getpid(), len(read_rows(metrics))))
                if usage_out is not None:
                    append_sample(usage_out, samples[-1])
    finally:
        for task in (*helpers, run):
            task.cancel()  # (a no-op on a run that ended)
        await asyncio.gather(*helpers, run, return_exceptions=True)
    rows = read_rows(metrics) if stopped else run.result().rows
    report = check_rows(rows, config.rollout.rollout_batch_size,
                        config.rollout.n_samples_per_prompt, config.max_staleness)
    return {**report, "kills": len(kills), "seconds": time.perf_counter() - started,
            "stopped_by_budget": stopped, "usage": samples}


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
