"""Peak memory of a process and all its descendants, sampled from ``/proc`` (Linux).

``replayrl bench peer --grid`` runs each side in its own child process (replayrl's launcher
spawns its actors under it); :func:`run_sampled` starts the child and, every ``interval``
seconds until it exits, sums over the child and every descendant alive at that moment:

* RSS (``/proc/PID/status`` ``VmRSS``): resident pages of each process; pages shared between
  processes (the torch libraries each actor maps, shared-memory buffers) count once per process,
  so a multi-process side reads higher than its real footprint;
* PSS (``/proc/PID/smaps_rollup`` ``Pss``): each shared page divided among the processes that
  map it, so the sum over a tree is the tree's share of physical memory.

The peaks are of those sums. A process that lives shorter than ``interval`` may be missed.
Per process (``TreeMemory.by_process``), the peaks are kept by ``/proc/PID/comm`` name: an actor
is ``rrl:NAME`` (:mod:`replayrl.actors.process_title`), so ``replayrl bench memory`` can say
which actor holds what; processes that share a name are summed per sample.
"""
from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

PROC = Path("/proc")


@dataclass(frozen=True)
class TreeMemory:
    """Peak summed RSS and PSS (bytes) of a process tree over its samples, and the sample count.

    ``by_process``: ``{comm name: (peak RSS, peak PSS)}`` in bytes, each the peak over the
    samples of the sum over the processes of that name (the two peaks may fall on different
    samples).
    """

    peak_rss_bytes: int
    peak_pss_bytes: int
    samples: int
    by_process: dict[str, tuple[int, int]] = field(default_factory=dict)


def _kib_field(path: Path, name: str) -> int:
    """``name:  N kB`` of a /proc file, in bytes; 0 when the process is gone or lacks it."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def parent_map(proc: Path = PROC) -> dict[int, int]:
    """``{pid: parent pid}`` of every process in ``proc`` (``/proc/PID/stat`` field 4)."""
    parents = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (field 2) is parenthesised and may hold spaces: split after it
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents


def descendants(root: int, parents: Mapping[int, int]) -> list[int]:
    """``root`` and every process whose chain of parents reaches it, root first."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(sorted(children.get(pid, ())))
    return out


def tree_usage(root: int, proc: Path = PROC) -> tuple[int, int]:
    """``(summed RSS, summed PSS)`` in bytes of ``root`` and its descendants now."""
    return _totals(usage_by_name(root, proc))


def _totals(named: Mapping[str, tuple[int, int]]) -> tuple[int, int]:
    """``(summed RSS, summed PSS)`` of :func:`usage_by_name`'s figures."""
    return sum(r for r, _ in named.values()), sum(p for _, p in named.values())


def _comm(path: Path) -> str:
    """``/proc/PID/comm`` without its newline; ``"?"`` when the process is gone."""
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def usage_by_name(root: int, proc: Path = PROC) -> dict[str, tuple[int, int]]:
    """``{comm name: (summed RSS, summed PSS)}`` in bytes over ``root`` and its descendants now,
    processes of one name summed."""
    out: dict[str, tuple[int, int]] = {}
    for pid in descendants(root, parent_map(proc)):
        rss = _kib_field(proc / str(pid) / "status", "VmRSS")
        pss = _kib_field(proc / str(pid) / "smaps_rollup", "Pss")
        if not rss and not pss:
            continue  # gone (or a kernel thread): nothing to count
        name = _comm(proc / str(pid) / "comm")
        r, p = out.get(name, (0, 0))
        out[name] = (r + rss, p + pss)
    return out


def run_sampled(cmd: Sequence[str], env: Mapping[str, str], interval: float = 0.25
                ) -> tuple[subprocess.CompletedProcess, TreeMemory]:
    """Run ``cmd`` to its end (stdout / stderr captured as text) while sampling its tree's
    memory every ``interval`` seconds; returns the finished process and the peaks."""
    proc = subprocess.Popen(list(cmd), env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peaks = [0, 0, 0]
    by_process: dict[str, tuple[int, int]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            named = usage_by_name(proc.pid)
            rss, pss = _totals(named)
            peaks[0], peaks[1], peaks[2] = max(peaks[0], rss), max(peaks[1], pss), peaks[2] + 1
            for name, (r, p) in named.items():
                old = by_process.get(name, (0, 0))
                by_process[name] = (max(old[0], r), max(old[1], p))
            done.wait(interval)

    sampler = threading.Thread(target=sample, name="tree-memory", daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate()
    finally:
        done.set()
        sampler.join()
    return (subprocess.CompletedProcess(list(cmd), proc.returncode, out, err),
            TreeMemory(peaks[0], peaks[1], peaks[2], dict(by_process)))
