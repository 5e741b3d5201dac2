"""``replayrl bench faults``: what each fault costs a real run, as a table.

Runs the real multi-process system on the embedded default with small settings: two
fault-free reference runs (two engines, one engine), then one run per fault, each hitting a
real process with a real signal at a known call (:mod:`replayrl.tools.bench.fault_injection`):

- an engine SIGKILLed, or SIGSTOPped (then killed at ``--heartbeat-deadline-s``), in the
  middle of rollout 1 under ``--engine-failure regenerate`` (two engines), ``restart`` (one
  engine: the rollout waits for the new process) and ``fail``;
- the trainer SIGSTOPped at step 1, the clock and the rollout manager SIGKILLed in step 1,
  with ``--save-interval 1``: the run must end with that actor's ``ActorDied`` and its last
  checkpoint must load (``replayrl.tools.run.launcher.check_load``).

Columns: the outcome; *time to recover*, the seconds step 0 (which waits for rollout 1) took
beyond the same step of the fault-free run with as many engines, measured in this run; for a
run that ends, the seconds from the fault to the end of ``launch``; *samples lost /
duplicated*, the trained samples missing from or beyond ``--rollout-batch-size`` x
``--n-samples-per-prompt`` per step; *same batches*, whether every step trained exactly the
figures of the fault-free run (prompts, samples, rewards, losses' inputs and gradient norm):
a regenerated group on another engine at the same weights must give the same trajectories.

``--chaos SECONDS --steps N -- FLAGS``: the chaos soak instead, one ``replayrl train FLAGS`` run
of N steps with a random engine SIGKILLed about every SECONDS (:mod:`replayrl.tools.bench.chaos`);
``--usage-every K`` adds every process's RSS and open fds every K steps and whether each stayed
flat (:mod:`replayrl.tools.bench.proc_usage`), ``--time-budget-s`` stops a long one in time.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from replayrl.actors import ActorDied
from replayrl.tools.bench.fault_injection import faulty_specs
from replayrl.tools.bench.usage import bench_parser
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, check_load, launch, write_initial_checkpoint

SAME = ("prompt_indices", "samples", "reward_mean", "response_len_mean", "trainer_version",
        "staleness_max", "grad_norm", "train_rollout_logprob_abs_diff", "accepted_tokens")
"""Row keys that must match the fault-free run when the step trained the same batch."""


@dataclass(frozen=True)
class FaultCase:
    """One fault: the ``actor`` hit, the ``signal`` and the ``call`` (:mod:`replayrl.tools.bench.fault_injection`), the
    ``policy`` (``--engine-failure``) and the engines of the run."""

    name: str
    actor: str
    signal: str
    call: int
    policy: str
    engines: int


CASES = (
    FaultCase("engine SIGKILL mid-rollout", "engine_1", "SIGKILL", 2, "regenerate", 2),
    FaultCase("engine SIGSTOP mid-rollout", "engine_1", "SIGSTOP", 2, "regenerate", 2),
    FaultCase("only engine SIGKILL", "engine_0", "SIGKILL", 2, "restart", 1),
    FaultCase("only engine SIGSTOP", "engine_0", "SIGSTOP", 2, "restart", 1),
    FaultCase("engine SIGKILL", "engine_1", "SIGKILL", 2, "fail", 2),
    FaultCase("trainer SIGSTOP in step 1", "trainer", "SIGSTOP", 2, "regenerate", 1),
    FaultCase("clock SIGKILL in step 1", "version_clock", "SIGKILL", 2, "regenerate", 1),
    FaultCase("manager SIGKILL in step 1", "rollout_manager", "SIGKILL", 3, "regenerate", 1),
)


def _values(out: Path, steps: int, batch: int, n: int, engines: int, deadline: float,
            **extra) -> dict:
    return {"num-steps": steps, "rollout-batch-size": batch, "n-samples-per-prompt": n,
            "num-engines": engines, "heartbeat-deadline-s": deadline, "progress": False,
            "save-interval": 1, "output-dir": str(out), **extra}


async def _case(case: FaultCase, out: Path, base: dict, reference: list[dict]) -> str:
    config = build_config({**base, "output-dir": str(out), "num-engines": case.engines,
                           "engine-failure": case.policy})
    checkpoint = write_initial_checkpoint(config, out / "ckpt")
    marker = out / "fault.json"
    specs = faulty_specs(actor_specs(config, checkpoint), case.actor, case.signal, case.call,
                         marker)
    expected = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
    try:
        result = await launch(config, specs=specs)
    except ActorDied as exc:
        ended = time.time()
        fault = json.loads(marker.read_text())
        saved = sorted(p.name for p in Path(config.save_dir).iterdir()
                       if not p.name.endswith(".partial"))
        loads = "none saved"
        if saved:
            try:
                check_load(build_config({**base, "output-dir": str(out / "again"),
                                         "num-engines": case.engines,
                                         "load": str(Path(config.save_dir) / saved[-1])}))
                loads = f"{saved[-1]} loads"
            except ConfigError as err:
                loads = f"{saved[-1]} does NOT load: {err}"
        return (f"| {case.name} | {case.policy} | run ends: ActorDied({exc.actor}, exit "
                f"{exc.exitcode}); last checkpoint {loads} | {ended - fault['time']:.1f} s to "
                f"end | — (a resume is exact: bench resume) | — |")
    rows = result.rows
    lost = sum(max(0, expected - r["samples"]) for r in rows)
    extra = sum(max(0, r["samples"] - expected) for r in rows)
    same = all(r[k] == ref[k] for r, ref in zip(rows, reference) for k in SAME)
    recover = rows[0]["step_seconds"] - reference[0]["step_seconds"]
    return (f"| {case.name} | {case.policy} | {len(rows)}/{len(reference)} steps; "
            f"{sum(r['groups_regenerated'] for r in rows)} groups regenerated; engines alive "
            f"{' '.join(str(r['engines_alive']) for r in rows)} | {recover:+.1f} s | "
            f"{lost} / {extra} | {'yes' if same else 'no (newer weights)'} |")


async def bench(steps: int, batch: int, n: int, deadline: float, names: list[str]) -> str:
    """Run the references and the chosen faults; return the markdown report."""
    cases = [c for c in CASES if not names or any(w in c.name for w in names)]
    with tempfile.TemporaryDirectory(prefix="rrl-bench-faults-") as tmp:
        out = Path(tmp)
        base = _values(out, steps, batch, n, 2, deadline)
        references = {}
        for engines in sorted({c.engines for c in cases}):
            result = await launch(build_config({**base, "num-engines": engines,
                                                "output-dir": str(out / f"ref{engines}")}))
            references[engines] = result.rows
        lines = [await _case(c, out / f"case{i}", base, references[c.engines])
                 for i, c in enumerate(cases)]
    return "\n".join([
        f"{steps} steps x {batch} groups x {n} samples, heartbeat deadline {deadline} s, "
        f"faults at rollout 1 / step 1; reference step 0: "
        + ", ".join(f"{e} engine(s) {r[0]['step_seconds']:.1f} s" for e, r in references.items()),
        "",
        "| fault | --engine-failure | outcome | time to recover | samples lost / duplicated "
        "| same batches as fault-free |",
        "|---|---|---|---|---|---|",
        *lines,
    ])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: prints the report."""
    parser = bench_parser("faults", __doc__)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of every run")
    parser.add_argument("--rollout-batch-size", type=int, default=4,
                        help="prompt groups per step (replayrl train's flag)")
    parser.add_argument("--n-samples-per-prompt", type=int, default=4,
                        help="trajectories per prompt group (replayrl train's flag)")
    parser.add_argument("--heartbeat-deadline-s", type=float, default=2.0,
                        help="seconds a stopped actor may stay silent before it counts as lost "
                             "(replayrl train's flag)")
    parser.add_argument("--only", nargs="*", default=[], metavar="WORD",
                        help="run only the faults whose name contains one of these words "
                             "(default: every fault)")
    parser.add_argument("--chaos", type=float, default=0.0, metavar="SECONDS",
                        help="the chaos soak: one run of --steps steps with a random engine "
                             "SIGKILLed about every SECONDS (0: the fault table)")
    parser.add_argument("--seed", type=int, default=0, help="with --chaos: the seed of the kills' random draws")
    parser.add_argument("--usage-every", type=int, default=0, metavar="N",
                        help="with --chaos: sample every process's RSS and open fds every N steps "
                             "and print whether each stayed flat (0: no sampling)")
    parser.add_argument("--warmup-step", type=int, default=50, metavar="STEP",
                        help="with --usage-every: the step whose sample is each process's start")
    parser.add_argument("--time-budget-s", type=float, default=None, metavar="SECONDS",
                        help="with --chaos: stop the run after SECONDS and report the steps it "
                             "trained (default: run every --steps)")
    parser.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                        help="with --chaos: the run's --output-dir, kept with usage.jsonl (the "
                             "samples) (default: a temporary directory, removed)")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER,
                        help="with --chaos: the run's replayrl train flags, after -- (default: none)")
    args = parser.parse_args(argv)
    from replayrl.actors import run_event_loop

    if args.chaos:
        from replayrl.tools.bench import chaos

        flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
        given = flags
        flags = ["--num-steps", str(args.steps), "--rollout-batch-size",
                 str(args.rollout_batch_size), "--n-samples-per-prompt",
                 str(args.n_samples_per_prompt), "--heartbeat-deadline-s",
                 str(args.heartbeat_deadline_s), *flags]
        if args.usage_every < 0 or args.warmup_step < 0:
            parser.error("--usage-every and --warmup-step must be >= 0")
        if args.time_budget_s is not None and args.time_budget_s <= 0:
            parser.error(f"--time-budget-s must be > 0, got {args.time_budget_s}")
        with tempfile.TemporaryDirectory(prefix="rrl-bench-chaos-") as tmp:
            out = args.run_dir if args.run_dir is not None else Path(tmp) / "run"
            try:
                config = chaos.chaos_config(flags, out)
            except ConfigError as exc:
                parser.error(str(exc))
            usage_out = out / "usage.jsonl" if args.run_dir is not None else None
            report = run_event_loop(chaos.soak(config, args.chaos, args.seed, args.usage_every,
                                               usage_out, args.time_budget_s))
        print(chaos.HEADER)
        print(chaos.row(given, report))
        if report["stopped_by_budget"]:
            print(f"\nstopped by --time-budget-s {args.time_budget_s:g} after {report['steps']} of "
                  f"{args.steps} steps")
        if args.usage_every:
            from replayrl.tools.bench.proc_usage import flat_table

            print()
            print(flat_table(report["usage"], args.warmup_step) if report["usage"]
                  else "no usage sample: the run ended before --usage-every steps")
        return 0 if report["ok"] else 1
    elif args.train_flags:
        parser.error("replayrl train flags are for --chaos only")

    print(run_event_loop(bench(args.steps, args.rollout_batch_size, args.n_samples_per_prompt,
                               args.heartbeat_deadline_s, args.only)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
