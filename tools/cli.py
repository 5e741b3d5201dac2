"""The replayrl command: train, sft, repl, keys, serve and bench (the benchmarks named in BENCHES).

Exit codes (:mod:`replayrl.tools.run.exit_codes`): 0 success, 1 a run failed (the failing actor's traceback
is printed), 2 bad configuration, 130 interrupted by Ctrl-C, 143 SIGTERM (``train``).

``serve`` puts the embedded engine behind SGLang's HTTP API (:mod:`replayrl.tools.serve`).
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
import time

from replayrl.tools.run.exit_codes import exit_code, handle_sigterm, until_terminated
from replayrl.tools.run.flags import add_run_flags
from replayrl.tools.run.from_flags import config_from_args
from replayrl.tools.sft.config import add_sft_flags


def _train(args: argparse.Namespace) -> int:
    started = time.perf_counter()  # the summary's "with start-up" counts torch's import too

    def run() -> int:
        # imported here: torch takes seconds, and a Ctrl-C meanwhile must still exit 130
        from replayrl.actors import run_event_loop
        from replayrl.tools.run.launcher import launch

        config = config_from_args(args)
        handle_sigterm()
        try:  # `kill -USR1 PID` prints where the launcher is, as it does for every actor process
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (OSError, ValueError):  # a stderr with no file descriptor (one captured in-process)
            pass
        result = run_event_loop(until_terminated(launch(
            config, log_level=getattr(logging, args.log_level), started=started)))
        print(f"plot: {result.plot_path}")
        print(result.summary)
        return 0

    return exit_code(run)


def _sft(args: argparse.Namespace) -> int:
    started = time.perf_counter()

    def run() -> int:
        from replayrl.rollout.errors import PromptDataError, TokenizerError
        from replayrl.tools.errors import ConfigError
        from replayrl.tools.sft.config import sft_config_from_args
        from replayrl.tools.sft.loop import run_sft

        try:  # bad data is bad input, as a bad flag: exit 2, the message naming FILE:LINE
            result = run_sft(sft_config_from_args(args), started=started)
        except (PromptDataError, TokenizerError) as exc:
            raise ConfigError(str(exc)) from None
        print(f"plot: {result.plot_path}")
        print(result.summary)
        return 0

    return exit_code(run)


def _repl(args: argparse.Namespace) -> int:
    from replayrl.tools.console.repl import main as repl_main

    return repl_main(args)


def _serve(args: argparse.Namespace) -> int:
    def run() -> int:
        from replayrl.tools.run.extras_check import require_extra

        require_extra("replayrl serve", "aiohttp", "serve")  # an extra, as --lora-rank's peft
        from replayrl.tools.serve import main as serve_main

        return serve_main(args)

    return exit_code(run)


def _keys(args: argparse.Namespace) -> int:
    def run() -> int:
        from replayrl.tools.errors import ConfigError
        from replayrl.transport.curve import create_keys
        from replayrl.transport.errors import TransportError

        try:
            written = create_keys(args.directory)
        except TransportError as exc:  # keys already there, or an unwritable directory: the user's
            raise ConfigError(f"replayrl keys {args.directory}: {exc}") from None
        print(f"CURVE key pair written: {written} (pass --curve-keys "
              f"{args.directory} to every process of the run)")
        return 0

    return exit_code(run)


BENCHES = {"parity": "replayrl.tools.bench.parity", "refill": "replayrl.tools.bench.refill",
           "logprobs": "replayrl.tools.bench.logprobs", "transport": "replayrl.tools.bench.transport",
           "peer": "replayrl.tools.bench.peer_grid", "profile": "replayrl.tools.bench.profile",
           "train": "replayrl.tools.bench.train", "load": "replayrl.tools.bench.load",
           "engine": "replayrl.tools.bench.engine", "decode": "replayrl.tools.bench.decode",
           "steps": "replayrl.tools.bench.steps", "faults": "replayrl.tools.bench.faults",
           "traces": "replayrl.tools.bench.traces", "lora": "replayrl.tools.bench.lora",
           "memory": "replayrl.tools.bench.memory", "limit": "replayrl.tools.bench.limit",
           "gpu": "replayrl.tools.bench.gpu", "resume": "replayrl.tools.bench.resume"}


def bench_list() -> str:
    """The benchmarks of :data:`BENCHES`, one line each: its name and what it is for (the first
    paragraph of its module docstring, :func:`replayrl.tools.bench.usage.summary`)."""
    import importlib.util
    import textwrap

    from replayrl.tools.bench.usage import summary_of_file

    width = max(map(len, BENCHES)) + 2
    lines = []
    for name in sorted(BENCHES):
        text = summary_of_file(importlib.util.find_spec(BENCHES[name]).origin)
        lines.append(textwrap.fill(text, 100, initial_indent=f"  {name:<{width}}",
                                   subsequent_indent=" " * (width + 2)))
    return "\n".join(lines)


def _bench(args: argparse.Namespace) -> int:
    if args.bench is None:  # `replayrl bench` alone: what there is to run
        print(f"{BENCH_USAGE}\n\nbenchmarks:\n{bench_list()}")
        return 0
    import importlib

    # a benchmark's own failure keeps its traceback; Ctrl-C still exits 130
    return exit_code(lambda: importlib.import_module(BENCHES[args.bench]).main(args.bench_args),
                     failures=())


BENCH_USAGE = ("replayrl bench NAME [FLAGS]: run the benchmark NAME with its own FLAGS\n"
               "(`replayrl bench NAME --help` describes them).")


SERVE_RUN_FLAGS = ("hf-checkpoint", "model-indexer", "engine-dtype", "engine-torch-threads")
"""The run flags ``replayrl serve`` reads (:func:`replayrl.tools.serve.main`: the policy's shape and the
engine's precision and threads); the training flags are not its."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose epilog may be a function, called only when help is shown (the
    benchmark list reads eighteen source files: not at every ``replayrl train``)."""

    def format_help(self) -> str:
        """The help text, with a callable epilog called now."""
        epilog = self.epilog
        if callable(epilog):
            self.epilog = epilog()
        try:
            return super().format_help()
        finally:
            self.epilog = epilog


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="replayrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="run asynchronous GRPO on the embedded default")
    add_run_flags(train)
    train.add_argument("--log-level", default="WARNING",
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="log level of the actor processes (default: WARNING)")
    train.set_defaults(func=_train)
    sft = sub.add_parser("sft", help="supervised fine-tuning on chat conversations, loss on the "
                                     "assistant's tokens; --save-hf writes what "
                                     "`replayrl train --hf-checkpoint` loads (docs/sft.md)")
    add_sft_flags(sft)
    sft.set_defaults(func=_sft)
    repl = sub.add_parser("repl", help="interactive actor REPL: on its own actors, or attached "
                                       "to a running run (--attach)")
    add_run_flags(repl)
    repl.add_argument("--attach", default="", metavar="RUN",
                      help="attach to a running run instead of starting actors: its --output-dir "
                           "(where it keeps attach.json), or any actor's address tcp://HOST:PORT "
                           "(with --curve-keys) / ipc://PATH; leaving never stops the run "
                           "(default: none, the console starts actors of its own)")
    repl.set_defaults(func=_repl)
    serve = sub.add_parser("serve", help="the embedded engine behind SGLang's HTTP API "
                                         "(what --rollout-engine sglang talks to; extra 'serve')")
    add_run_flags(serve, only=SERVE_RUN_FLAGS)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=30000,
                       help="port (default: 30000, SGLang's; 0 = any free port)")
    serve.set_defaults(func=_serve)
    keys = sub.add_parser("keys", help="make a run's CURVE key pair (needed by --transport tcp)")
    keys.add_argument("directory", help="where run.key and run.key_secret (mode 600) are written")
    keys.set_defaults(func=_keys)
    bench = sub.add_parser("bench", help=f"benchmarks: {' | '.join(BENCHES)} (flags after the name go "
                                         f"to the benchmark; `replayrl bench NAME --help` describes it)",
                           description=BENCH_USAGE, epilog=lambda: f"benchmarks:\n{bench_list()}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("bench", nargs="?", choices=sorted(BENCHES), metavar="NAME",
                       help="the benchmark to run (listed below); none: list them")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="FLAGS",
                       help="the benchmark's own flags")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``replayrl`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
