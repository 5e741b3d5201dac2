"""Per-process resident memory and open file descriptors of a run's process tree over its steps,
and whether each process stayed flat (``replayrl bench faults --chaos``'s long soak).

:func:`sample_tree` reads, for the launcher (this process) and every descendant alive at that
moment (the actors: ``rrl:NAME`` ``comm`` names, :mod:`replayrl.actors.process_title`), from
``/proc/PID``: ``VmRSS`` (resident now) and ``VmHWM`` (the process's peak resident set) of
``status``, and the entries of ``fd`` (open descriptors). The process tree comes from
:mod:`replayrl.tools.bench.tree_memory`. :func:`flat_table` turns samples taken every N steps
into one row per process name: RSS and fds at the first sample from the warm-up step on and at the
last sample, the peak ``VmHWM``, the RSS slope, and the verdict of :func:`is_flat`. A process
killed and started again under the same name (a restarted engine) is a new pid: its row's end
figures are the replacement's, and the row says so.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Iterable, Sequence

from replayrl.tools.bench.tree_memory import PROC, _comm, _kib_field, descendants, parent_map
from replayrl.transport import strict_json

MIB = 1 << 20
RSS_SLACK_FRACTION = 0.10
"""An end RSS up to this fraction above the start RSS (plus :data:`RSS_SLACK_BYTES`) is flat."""
RSS_SLACK_BYTES = 20 * MIB
"""Absolute RSS slack of :func:`is_flat`: allocator arenas and caches settle by a few MiB."""
FD_SLACK = 2
"""At most this many more open descriptors at the end than at the start is flat."""
LAUNCHER = "launcher"
"""The name :func:`sample_tree` gives the tree's root (the process running the soak)."""


def process_usage(pid: int, proc: Path = PROC) -> dict | None:
    """``{"rss", "hwm", "fds", "fd_kinds"}`` of process ``pid`` now: ``VmRSS`` and ``VmHWM`` in
    bytes, the count of ``/proc/PID/fd`` entries and that count per :func:`fd_kind`; ``None``
    when it is gone, a zombie or a kernel thread (no ``VmRSS``) or its descriptors cannot be
    read."""
    base = proc / str(pid)
    rss = _kib_field(base / "status", "VmRSS")
    if not rss:
        return None
    try:
        names = os.listdir(base / "fd")
    except OSError:  # it exited between the two reads
        return None
    kinds: dict[str, int] = {}
    for fd in names:
        kind = fd_kind(base / "fd" / fd)
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"rss": rss, "hwm": _kib_field(base / "status", "VmHWM"), "fds": len(names),
            "fd_kinds": kinds}


def fd_kind(link: Path) -> str:
    """What an open descriptor (a ``/proc/PID/fd/N`` link) is: ``socket``, ``pipe``,
    ``anon_inode`` (eventfd, epoll, ...), ``memfd`` (``memfd_create``: the shared-memory slots of
    :mod:`replayrl.transport.shm_pool`), ``shm`` (under ``/dev/shm``), ``dev``, ``file``, or
    ``gone`` (closed while we looked)."""
    try:
        target = os.readlink(link)
    except OSError:
        return "gone"
    if not target.startswith("/"):
        return target.split(":", 1)[0]  # socket:[N], pipe:[N], anon_inode:[eventfd]
    if target.startswith("/memfd:"):  # "/memfd:NAME (deleted)": a transport pool slot, say
        return "memfd"
    if target.startswith("/dev/shm/"):
        return "shm"
    return "dev" if target.startswith("/dev/") else "file"


def sample_tree(root: int, step: int, proc: Path = PROC, now: float | None = None) -> dict:
    """One sample of ``root`` and its live descendants after ``step`` steps:
    ``{"step", "time" (wall-clock seconds), "procs": [{"pid", "name", "rss", "hwm", "fds",
    "fd_kinds"}]}`` (:func:`process_usage`);
    ``root`` is named :data:`LAUNCHER`, every other process by its ``comm``."""
    procs = []
    for pid in descendants(root, parent_map(proc)):
        usage = process_usage(pid, proc)
        if usage is None:
            continue
        name = LAUNCHER if pid == root else _comm(proc / str(pid) / "comm")
        procs.append({"pid": pid, "name": name, **usage})
    return {"step": step, "time": time.time() if now is None else now, "procs": procs}


def is_flat(start_rss: int, end_rss: int, start_fds: int, end_fds: int) -> bool:
    """Whether a process stayed flat: end RSS at most start x (1 + :data:`RSS_SLACK_FRACTION`) +
    :data:`RSS_SLACK_BYTES`, and end fds at most start + :data:`FD_SLACK` (bytes, counts)."""
    return (end_rss <= start_rss * (1 + RSS_SLACK_FRACTION) + RSS_SLACK_BYTES
            and end_fds - start_fds <= FD_SLACK)


def _series(samples: Iterable[dict]) -> dict[str, list[tuple[int, dict]]]:
    """``{name: [(step, proc entry), ...]}`` in sample order. A pid is named by its last sample
    (a process sampled before it set its ``comm``, a new engine still ``python3.11``, belongs to
    its actor); a name held by several live pids in one sample (helpers of one ``comm``) is
    split as ``name``, ``name#2``, ... by pid order."""
    samples = list(samples)
    final = {p["pid"]: p["name"] for sample in samples for p in sample["procs"]}
    out: dict[str, list[tuple[int, dict]]] = {}
    for sample in samples:
        seen: dict[str, int] = {}
        for entry in sorted(sample["procs"], key=lambda p: p["pid"]):
            name = final[entry["pid"]]
            seen[name] = seen.get(name, 0) + 1
            key = name if seen[name] == 1 else f"{name}#{seen[name]}"
            out.setdefault(key, []).append((sample["step"], entry))
    return out


def _settled(points: Sequence[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """``points`` without each pid's first sample: a process sampled for the first time may be
    one still starting (a restarted engine importing torch), not yet at its working size."""
    seen: set[int] = set()
    out = []
    for step, entry in points:
        if entry["pid"] in seen:
            out.append((step, entry))
        seen.add(entry["pid"])
    return out


def _slope(points: Sequence[tuple[int, dict]]) -> float | None:
    """Least-squares RSS slope in MiB per 1,000 steps over ``points``; ``None`` under 3 points
    or a single step."""
    if len(points) < 3 or len({s for s, _ in points}) < 2:
        return None
    fit = statistics.linear_regression([s for s, _ in points], [p["rss"] / MIB for _, p in points])
    return fit.slope * 1000


WINDOW = 5
"""Samples of one pid whose median is a start or end figure (fewer for a short series: a
quarter of the pid's samples, at least one): an engine restarting beside a process adds
sockets and pipes to it for a sample or two, which one sample would read as growth."""


def _window(points: Sequence[tuple[int, dict]], pid: int, first: bool) -> dict:
    """``{"steps": (first, last step), "pid", "rss", "fds"}``: the medians (the lower middle
    value) over the first (or last) window of ``pid``'s ``points`` (:data:`WINDOW`)."""
    own = [p for p in points if p[1]["pid"] == pid]
    size = max(1, min(WINDOW, len(own) // 4))
    chosen = own[:size] if first else own[-size:]
    return {"steps": (chosen[0][0], chosen[-1][0]), "pid": pid,
            "rss": statistics.median_low(p["rss"] for _, p in chosen),
            "fds": statistics.median_low(p["fds"] for _, p in chosen)}


def flat_rows(samples: Sequence[dict], warmup_step: int) -> list[dict]:
    """One row per process name over ``samples`` (:func:`sample_tree`'s, in step order).

    Each pid's first sample is left out (:func:`_settled`), so a name whose every pid was
    sampled once (a process killed while it started) has no row. The start pid is the one of the
    first kept sample at or after ``warmup_step`` (or the first kept sample, for a name that
    appears only later), the end pid the one of the last. Each row: ``name``; ``start`` and
    ``end`` (:func:`_window`: medians over the start pid's first and the end pid's last
    :data:`WINDOW` kept samples, from the warm-up on); ``peak_hwm`` (bytes, the largest
    ``VmHWM`` over every sample and pid of the name); ``pids`` (distinct pids seen under the
    name: more than one is a process replaced, e.g. an engine restarted after a kill);
    ``replaced_at`` (the first step the end pid was sampled, when it is not the start pid, else
    ``None``); ``slope`` (MiB per 1,000 steps, least squares over the end pid's kept samples
    from the warm-up on, or ``None``); ``flat`` (:func:`is_flat` of start against end).

    Raises:
        ValueError: no sample.
    """
    if not samples:
        raise ValueError("no usage samples: the run ended before its first sample")
    rows = []
    for name, points in _series(samples).items():
        settled = _settled(points)
        if not settled:  # every pid of it sampled once: started and gone between two samples
            continue
        kept = [p for p in settled if p[0] >= warmup_step] or settled
        start_pid, end_pid = kept[0][1]["pid"], kept[-1][1]["pid"]
        start, end = _window(kept, start_pid, True), _window(kept, end_pid, False)
        rows.append({
            "name": name, "start": start, "end": end,
            "peak_hwm": max(p["hwm"] for _, p in points),
            "pids": len({p["pid"] for _, p in points}),
            "replaced_at": None if end_pid == start_pid else next(
                s for s, p in points if p["pid"] == end_pid),
            "slope": _slope([p for p in kept if p[1]["pid"] == end_pid]),
            "flat": is_flat(start["rss"], end["rss"], start["fds"], end["fds"]),
        })
    return sorted(rows, key=lambda r: (r["name"] != LAUNCHER, r["name"]))


def flat_table(samples: Sequence[dict], warmup_step: int) -> str:
    """The markdown table of :func:`flat_rows`: process, steps, RSS start / end / peak (MiB),
    fds start / end, RSS slope, verdict (``flat``, or ``GROWS``), with the rule under it."""
    lines = ["| process | sampled steps (start - end) | RSS start / end / peak MiB | fds start / end "
             "| RSS slope MiB per 1k steps | verdict |", "|---|---|---|---|---|---|"]
    for r in flat_rows(samples, warmup_step):
        name = r["name"]
        if name == LAUNCHER:
            name += " (serves version_clock, rollout_manager)"
        if r["replaced_at"] is not None:
            name += (f" (end: replacement pid {r['end']['pid']}, sampled from step "
                     f"{r['replaced_at']}; {r['pids']} pids over the run)")
        elif r["pids"] > 1:
            name += f" ({r['pids']} pids over the run; start and end: pid {r['end']['pid']})"
        slope = "—" if r["slope"] is None else f"{r['slope']:+.2f}"
        lines.append(
            f"| {name} | {r['start']['steps'][0]} - {r['end']['steps'][1]} | "
            f"{r['start']['rss'] / MIB:.0f} / "
            f"{r['end']['rss'] / MIB:.0f} / {r['peak_hwm'] / MIB:.0f} | {r['start']['fds']} / "
            f"{r['end']['fds']} | {slope} | {'flat' if r['flat'] else 'GROWS'} |")
    lines.append(f"\nstart / end: medians over the first / last {WINDOW} samples of the start / "
                 f"end pid from the warm-up on; flat: end RSS <= start x {1 + RSS_SLACK_FRACTION:.2f} + "
                 f"{RSS_SLACK_BYTES // MIB} MiB and end fds - start fds <= {FD_SLACK}; peak: "
                 "largest VmHWM of any pid of the name; each pid's first sample is left out (it may be "
                 "starting), and a process sampled only once has no row.")
    return "\n".join(lines)


def read_samples(path: Path) -> list[dict]:
    """The samples of a jsonl file written by :func:`append_sample`, in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_sample(path: Path, sample: dict) -> None:
    """Append ``sample`` as one json line to ``path``."""
    with path.open("a") as f:
        f.write(strict_json.dumps(sample) + "\n")
