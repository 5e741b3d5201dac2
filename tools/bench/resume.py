"""``replayrl bench resume``: a run killed by SIGKILL and resumed with ``--load``, against an uninterrupted one.

For each cell (a backend, a model, a loop, a data path: :data:`CELLS`) the same ``replayrl train``
command (``--save-interval 1``) runs three times, each as its own process group:

1. uninterrupted, ``--num-steps N``;
2. killed (SIGKILL of the whole process group) at a random moment: after a random number of
   rows, a random fraction of a step later;
3. killed while a checkpoint is written: ``replayrl.tools.bench.kill_in_save`` kills the group
   when the trainer and the rollout manager have written their files of a random checkpoint
   and the run state and the rename are still to come (deterministic, no poll).

Each killed run is then resumed with the same command plus ``--load`` of its last complete
checkpoint (``replayrl.tools.run.checkpoint_dirs.latest_checkpoint``; a ``.partial`` one is never
taken) into the same output directory, and its ``metrics.jsonl`` is compared with the
uninterrupted run's, row by row, on every key but the timings (names with ``second``): equal,
or the first differing step and key. The prompts of the rows (``prompt_indices``) are counted
against the uninterrupted run's: a prompt trained more often is "twice", less often "skipped".

Prints a markdown table and writes every figure to ``OUT/resume.json``.
"""
from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from replayrl.tools.bench.usage import bench_parser
from replayrl.tools.run.checkpoint_dirs import latest_checkpoint
from replayrl.transport import strict_json

BASE = {"rollout-batch-size": 4, "n-samples-per-prompt": 4, "save-interval": 1, "seed": 1}
"""Flags of every cell's command (``--num-steps``, ``--output-dir`` and ``--no-progress`` added)."""

CELLS: dict[str, dict] = {
    "torch-async": {},
    "torch-sync": {"max-staleness": 0},
    "torch-async-refill": {"rs-mode": "geometric", "rs-lower": 0.9, "rs-upper": 1.1,
                           "rs-batch-refill": True, "rs-refill-max-rounds": 8},
    "torch-async-dynamic": {"dynamic-sampling": True, "rs-refill-max-rounds": 8},
    "torch-async-lora": {"lora-rank": 4, "lr": 1e-3},
    "fsdp-dp2-async": {"train-backend": "fsdp", "dp-size": 2},
    "megatron-tp2-async": {"train-backend": "megatron", "tp-size": 2},
}
"""The cells ``--cells all`` runs: name -> flags over :data:`BASE`. A family checkpoint and an
``--env`` environment need files: such a cell is given with ``--extra``."""

TIMING = "second"
"""A key naming a duration or a rate (``*_seconds``, ``*_per_second``): differs run to run."""


def argv_of(flags: dict) -> list[str]:
    """``replayrl train`` arguments of flag -> value: ``True`` is the bare switch, a list
    repeats the flag."""
    out: list[str] = []
    for key, value in flags.items():
        if value is True:
            out.append(f"--{key}")
        elif isinstance(value, (list, tuple)):
            for item in value:
                out += [f"--{key}", str(item)]
        else:
            out += [f"--{key}", str(value)]
    return out


def read_rows(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (a cut-short last line left out)."""
    from replayrl.tools.run.metrics import earlier_rows

    return earlier_rows(path) if path.exists() else []


def compare(reference: list[dict], rows: list[dict]) -> dict:
    """Row-by-row comparison of every non-timing key.

    Returns:
        ``{"equal": bool, "steps": [int], "first_difference": None | {"step", "key",
        "uninterrupted", "resumed"}, "prompts_twice": int, "prompts_skipped": int}``; steps
        missing from either side are a difference at the first such step (key ``step``).
    """
    first = None
    for i in range(max(len(reference), len(rows))):
        if i >= len(reference) or i >= len(rows):
            step = (rows if i < len(rows) else reference)[i].get("step")
            first = {"step": step, "key": "step", "uninterrupted": len(reference),
                     "resumed": len(rows)}
            break
        a, b = reference[i], rows[i]
        for key in sorted(set(a) | set(b)):
            if TIMING not in key and a.get(key) != b.get(key):
                first = {"step": a.get("step"), "key": key, "uninterrupted": a.get(key),
                         "resumed": b.get(key)}
                break
        if first:
            break
    want = collections.Counter(p for r in reference for p in r.get("prompt_indices", ()))
    got = collections.Counter(p for r in rows for p in r.get("prompt_indices", ()))
    return {"equal": first is None, "steps": [r.get("step") for r in rows],
            "first_difference": first,
            "prompts_twice": sum((got - want).values()),
            "prompts_skipped": sum((want - got).values())}


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    """A child in a process group of its own, its output to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(child: subprocess.Popen, what: str, log: Path, timeout: float) -> None:
    """Wait for a child that must succeed.

    Raises:
        RuntimeError: it failed or ran over ``timeout`` seconds (names the log).
    """
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        raise RuntimeError(f"{what} ran over {timeout:.0f} s; see {log}") from None
    if code != 0:
        raise RuntimeError(f"{what} exited {code}; see {log}")


def _train(flags: dict) -> list[str]:
    return [sys.executable, "-m", "replayrl.tools.cli", "train", "--no-progress", *argv_of(flags)]


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _resume(flags: dict, out: Path, timeout: float) -> tuple[str, float]:
    """Resume the run in ``out`` from its last complete checkpoint (into ``out`` itself);
    returns the checkpoint's name and the seconds."""
    checkpoint = latest_checkpoint(out / "checkpoints")
    if checkpoint is None:
        raise RuntimeError(f"{out}: no complete checkpoint to resume from")
    log = out.parent / f"{out.name}.log"
    start = time.perf_counter()
    _finish(_start(_train({**flags, "output-dir": out, "load": checkpoint}), log),
            f"resume of {out}", log, timeout)
    return checkpoint.name, time.perf_counter() - start


def run_cell(name: str, flags: dict, steps: int, out: Path, rng: random.Random,
             timeout: float) -> dict:
    """One cell: the uninterrupted run, the two kills and their resumes, compared.

    Raises:
        RuntimeError: a run that must succeed failed (names its log).
    """
    flags = {**BASE, **flags, "num-steps": steps}
    shutil.rmtree(out, ignore_errors=True)  # the runs start in fresh output directories
    out.mkdir(parents=True)
    start = time.perf_counter()
    full = out / "uninterrupted"
    _finish(_start(_train({**flags, "output-dir": full}), out / "uninterrupted.log"),
            "uninterrupted run", out / "uninterrupted.log", timeout)
    seconds = time.perf_counter() - start
    reference = read_rows(full / "metrics.jsonl")
    step_seconds = sum(r["step_seconds"] for r in reference) / max(len(reference), 1)
    kills = []

    # 1. a random moment: after `after` rows (>= 2: checkpoint step-1 is complete by then),
    # a random fraction of a step later
    after, fraction = rng.randint(2, steps - 1), rng.random()
    killed = out / "killed-random"
    child = _start(_train({**flags, "output-dir": killed}), out / "killed-random.log")
    deadline = time.monotonic() + timeout
    while len(read_rows(killed / "metrics.jsonl")) < after and child.poll() is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    time.sleep(fraction * step_seconds)
    finished = child.poll() is not None
    _kill_group(child)
    rows_before = len(read_rows(killed / "metrics.jsonl"))
    partial = sorted(p.name for p in (killed / "checkpoints").glob("*.partial"))
    checkpoint, resume_seconds = _resume(flags, killed, timeout)
    kills.append({"kill": "random", "rows_before_kill": rows_before,
                  "finished_before_kill": finished, "partial_checkpoints": partial,
                  "resumed_from": checkpoint, "resume_seconds": resume_seconds,
                  **compare(reference, read_rows(killed / "metrics.jsonl"))})

    # 2. while checkpoint `at` is written (after the trainer's and the manager's files); `at`
    # >= 2: step-(at - 1) is there to resume from
    at = rng.randint(2, steps - 1)
    killed = out / "killed-in-checkpoint"
    log = out / "killed-in-checkpoint.log"
    child = _start([sys.executable, "-m", "replayrl.tools.bench.kill_in_save", str(at),
                    "--no-progress", *argv_of({**flags, "output-dir": killed})], log)
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        code = None
    rows_before = len(read_rows(killed / "metrics.jsonl"))
    partial = sorted(p.name for p in (killed / "checkpoints").glob("*.partial"))
    checkpoint, resume_seconds = _resume(flags, killed, timeout)
    kills.append({"kill": f"in checkpoint step-{at}", "exit": code,
                  "rows_before_kill": rows_before, "partial_checkpoints": partial,
                  "resumed_from": checkpoint, "resume_seconds": resume_seconds,
                  **compare(reference, read_rows(killed / "metrics.jsonl"))})
    return {"cell": name, "flags": flags, "uninterrupted_seconds": seconds, "kills": kills}


def table(results: list[dict]) -> str:
    """The markdown table of :func:`run_cell` results, one column per cell: the rows written
    before each kill (at random / in a checkpoint) and the checkpoints resumed from, how the
    resumed rows compare with the uninterrupted run's, and the prompts trained more / less
    often, both kills together."""
    cells = []
    for cell in results:
        if "error" in cell:
            cells.append(f"failed: {cell['error']}")
            continue
        kills = cell["kills"]
        texts = ["equal" if k["equal"] else
                 f"step {k['first_difference']['step']} `{k['first_difference']['key']}` differs"
                 for k in kills]
        cells.append(f"{' / '.join(str(k['rows_before_kill']) for k in kills)} -> "
                     f"{' / '.join(k['resumed_from'] for k in kills)}: "
                     f"{texts[0] if len(set(texts)) == 1 else ' / '.join(texts)}; "
                     f"{sum(k['prompts_twice'] for k in kills)} / "
                     f"{sum(k['prompts_skipped'] for k in kills)}")
    return "\n".join([
        "| cell | " + " | ".join(cell["cell"] for cell in results) + " |",
        "|---" * (len(results) + 1) + "|",
        "| rows when killed at random / in a checkpoint -> resumed from: rows after resume; "
        "prompts twice / skipped | " + " | ".join(cells) + " |"])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: runs the cells, prints the table, writes ``OUT/resume.json``;
    exit status 1 when a resumed run's rows differ."""
    parser = bench_parser("resume", __doc__)
    parser.add_argument("--cells", nargs="+", default=["torch-async", "torch-sync"],
                        help=f"cells to run, by name ({', '.join(CELLS)}) or 'all'")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=FLAGS",
                        help="one more cell: its name, '=', and the replayrl train flags over the "
                             "base ones, e.g. 'family=--hf-checkpoint DIR --lr 1e-3' "
                             "(repeatable) (default: none)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of each run (>= 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--out", default="bench-resume", help="directory of the runs and resume.json")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be >= 3, got {args.steps}")
    names = list(CELLS) if args.cells == ["all"] else args.cells
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        parser.error(f"unknown cells {unknown}; known: {list(CELLS)}")
    cells = [(n, CELLS[n]) for n in names]
    for extra in args.extra:
        name, _, text = extra.partition("=")
        if not name or not text.strip():
            parser.error(f"--extra {extra!r}: expected NAME=FLAGS")
        cells.append((name, _flags_of(text.split())))
    out = Path(args.out)
    rng = random.Random(args.seed)
    results = []
    for name, flags in cells:
        try:
            results.append(run_cell(name, flags, args.steps, out / name.replace(" ", "-"), rng,
                                    args.timeout))
        except RuntimeError as exc:  # a run that must succeed failed: the other cells go on
            results.append({"cell": name, "flags": flags, "error": str(exc), "kills": []})
        print(f"{name}: {results[-1].get('error') or [k['equal'] for k in results[-1]['kills']]}",
              file=sys.stderr)
    (out / "resume.json").write_text(strict_json.dumps(results, indent=1))
    print(f"{args.steps} steps per run, --save-interval 1, kill seed {args.seed}\n")
    print(table(results))
    print(f"\nfigures: {out / 'resume.json'}")
    return 0 if all(k["equal"] for c in results for k in c["kills"]) and not any(
        "error" in c for c in results) else 1


def _flags_of(words: list[str]) -> dict:
    """``["--a", "1", "--b"]`` -> ``{"a": "1", "b": True}``."""
    flags: dict = {}
    key = None
    for word in words:
        if word.startswith("--"):
            key = word[2:]
            flags[key] = True
        elif key is None:
            raise ValueError(f"{word!r} follows no flag")
        else:
            flags[key] = word
            key = None
    return flags


if __name__ == "__main__":
    raise SystemExit(main())
