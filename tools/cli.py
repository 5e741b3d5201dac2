"""``replayrl`` command line: ``train``, ``repl`` and ``bench {parity,refill,logprobs,transport}``.

Exit codes: 0 success, 1 a run failed (the failing actor's traceback is printed), 2 bad
configuration, 130 interrupted by Ctrl-C.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from tools.config import ConfigError, add_run_flags, config_from_args


class Terminated(KeyboardInterrupt):
    """SIGTERM (timeout, slurm, k8s) handled like Ctrl-C: stop every actor, then exit 143."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def _train(args: argparse.Namespace) -> int:
    from actors import run_event_loop
    from tools.launcher import launch

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"replayrl: configuration error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        result = run_event_loop(launch(config, log_level=getattr(logging, args.log_level)))
    except Terminated:
        print("replayrl: terminated; all actors stopped", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("replayrl: interrupted; all actors stopped", file=sys.stderr)
        return 130
    except ConfigError as exc:
        print(f"replayrl: configuration error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the actor's traceback is part of the message
        print(f"replayrl: run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"plot: {result.plot_path}")
    print(result.summary)
    return 0


def _repl(args: argparse.Namespace) -> int:
    from tools.repl import main as repl_main

    return repl_main(args)


BENCHES = {"parity": "tools.bench_parity", "refill": "tools.bench_refill",
           "logprobs": "tools.bench_logprobs", "transport": "tools.bench_transport"}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(BENCHES[args.bench]).main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="replayrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run asynchronous GRPO on the embedded default")
    add_run_flags(train)
    train.add_argument("--log-level", default="WARNING",
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="log level of the actor processes (default: WARNING)")
    train.set_defaults(func=_train)
    repl = sub.add_parser("repl", help="interactive actor REPL on a live run")
    add_run_flags(repl)
    repl.set_defaults(func=_repl)
    bench = sub.add_parser("bench", help="benchmarks: parity | refill | logprobs | transport "
                                         "(flags after the name go to the benchmark)")
    bench.add_argument("bench", choices=sorted(BENCHES))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``replayrl`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # e.g. Ctrl-C while torch is still importing, before any actor
        print("replayrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
