"""``replayrl bench refill``: exact refill off vs on, end to end on the embedded default.

Runs the real multi-process system three times with the same seed and an RS band:

1. RS on, refill off — rejected tokens are masked out, the step trains on what is left;
2. RS on, refill on — rejected prompt groups are replaced at the preflight version, every step
   trains on exactly ``--rollout-batch-size`` whole groups;
3. a band no importance ratio reaches (``[1e30, 1e30]``) with refill on — must stop with a
   clear error before any optimizer step.

Prints a markdown table: generated samples (request slots), seconds, effective (trained,
accepted) tokens and their rate, and every step's accepted samples (off) or admitted groups (on).
Effective tokens are loss tokens that contribute to the update (accepted by the gate).
"""
from __future__ import annotations

import tempfile
import time

from replayrl.actors import RemoteError
from replayrl.tools.bench.usage import bench_parser
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import launch


async def _run(values: dict) -> tuple[list[dict], float]:
    start = time.perf_counter()
    result = await launch(build_config(values))
    return result.rows, time.perf_counter() - start


async def bench(steps: int, batch: int, n: int, mode: str, lower: float, upper: float,
                seed: int) -> str:
    """Run the three configurations; return the markdown report."""
    with tempfile.TemporaryDirectory(prefix="rrl-bench-") as out:
        base = {"num-steps": steps, "rollout-batch-size": batch, "n-samples-per-prompt": n,
                "seed": seed, "progress": False, "rs-mode": mode, "rs-lower": lower,
                "rs-upper": upper}
        rows_off, sec_off = await _run({**base, "output-dir": f"{out}/off"})
        rows_on, sec_on = await _run({**base, "output-dir": f"{out}/on", "rs-batch-refill": True,
                                      "rs-refill-max-rounds": 8})
        try:
            await _run({**base, "num-steps": 1, "output-dir": f"{out}/all", "rs-lower": 1e30,
                        "rs-upper": 1e30, "rs-batch-refill": True, "rs-refill-max-rounds": 2})
            reject_all = "ran (unexpected)"
        except RemoteError as exc:
            reject_all = f"{exc.remote_type} before any optimizer step: {exc.remote_message}"

    def line(name, rows, seconds, per_step):
        tokens = sum(r["accepted_tokens"] for r in rows)
        return (f"| {name} | {sum(r['generated_samples'] for r in rows)} | {seconds:.1f} | "
                f"{tokens:.0f} | {tokens / seconds:.1f} | {per_step} |")

    rejected = 1 - sum(r["admitted_groups"] for r in rows_on) / sum(
        r["admitted_groups"] + r["rejected_groups"] for r in rows_on)
    return "\n".join([
        f"RS {mode} band [{lower}, {upper}], {steps} steps x {batch} groups x {n} samples, "
        f"seed {seed}; {rejected:.0%} of candidate groups rejected with refill on",
        "",
        "| refill | generated samples (request slots) | seconds | effective tokens | tokens/s | per step |",
        "|---|---|---|---|---|---|",
        line("off", rows_off, sec_off, "accepted samples: " + " ".join(
            f"{round(r['rs_sample_accept_rate'] * batch * n)}/{batch * n}" for r in rows_off)),
        line("on", rows_on, sec_on, "admitted groups: " + " ".join(
            f"{r['admitted_groups']}/{batch}" for r in rows_on)),
        "",
        f"band [1e30, 1e30] (no ratio reaches it), refill on: {reject_all}",
    ])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: prints the report."""
    parser = bench_parser("refill", __doc__)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of each run")
    parser.add_argument("--rollout-batch-size", type=int, default=8,
                        help="prompt groups per step (replayrl train's flag)")
    parser.add_argument("--n-samples-per-prompt", type=int, default=4,
                        help="trajectories per prompt group (replayrl train's flag)")
    parser.add_argument("--rs-mode", default="geometric",
                        help="RS gate of the first two runs: token, sequence or geometric "
                             "(replayrl train's flag)")
    parser.add_argument("--rs-lower", type=float, default=0.9,
                        help="lower importance-ratio bound of the RS band")
    parser.add_argument("--rs-upper", type=float, default=1.1,
                        help="upper importance-ratio bound of the RS band")
    parser.add_argument("--seed", type=int, default=1, help="seed of every run")
    args = parser.parse_args(argv)
    from replayrl.actors import run_event_loop

    print(run_event_loop(bench(args.steps, args.rollout_batch_size, args.n_samples_per_prompt,
                               args.rs_mode, args.rs_lower, args.rs_upper, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
