"""What the SGLang engine (:mod:`replayrl.rollout.engines.sglang_engine`) refuses of a run's
settings, checked before any process starts; light (no HTTP client, no torch), as the launcher
that checks it (docs/design/engines.md#sglang-engine)."""
from __future__ import annotations

from typing import Any

from replayrl.rollout.engines.sglang_protocol import parse_urls
from replayrl.rollout.errors import RolloutConfigError


def check_run(run: Any) -> None:
    """Refuse LoRA (replayrl sends adapter pushes only to the embedded engine).

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``trainer.lora_rank``.
    Raises:
        RolloutConfigError: ``--lora-rank`` given (names the flags).
    """
    if run.trainer.lora_rank:
        raise RolloutConfigError(
            "--lora-rank with --rollout-engine sglang: replayrl sends adapter pushes only to "
            "the embedded engine, which merges them (SGLang's LoRA request path is not "
            "wired); use --rollout-engine embedded")


def check_urls(run: Any) -> None:
    """The SGLang servers of any run: ``--sglang-urls`` is given exactly when the engine is
    SGLang's, with a server for every engine.

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``rollout_engine``, ``sglang_urls`` and ``num_engines``.
    Raises:
        RolloutConfigError: ``--rollout-engine sglang`` without ``--sglang-urls`` or the URLs
            with another engine; fewer URLs than ``--num-engines``.
    """
    if (run.rollout_engine == "sglang") != bool(run.sglang_urls):
        raise RolloutConfigError("--rollout-engine sglang needs --sglang-urls, and --sglang-urls "
                                 "is only read by --rollout-engine sglang")
    if run.sglang_urls and run.num_engines > len(parse_urls(run.sglang_urls)):
        raise RolloutConfigError(f"--num-engines {run.num_engines} > {len(parse_urls(run.sglang_urls))} "
                                 f"--sglang-urls: each SGLang server has one engine pushing its "
                                 f"weights (two would pause and update it under each other)")
