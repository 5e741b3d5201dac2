"""What the engine room refuses of a run's settings, before any process starts.

An engine with settings of its own to refuse has a light module beside it (no torch, no engine
import: the launcher that checks the run loads neither) with ``check_run(run)``, named in
:data:`RUN_CHECKS`; an engine not named there accepts every setting. A policy of the family room
(transformers' model in-process, rollout/model/families/) is served only by the engines of
:data:`FAMILY_ENGINES`.
"""
from __future__ import annotations

from typing import Any, Callable

from replayrl.rollout.engines import sglang_run_check, vllm_run_check
from replayrl.rollout.errors import RolloutConfigError
from replayrl.rollout.model.families.run_check import family_of

RUN_CHECKS: dict[str, Callable[[Any], None]] = {
    "vllm": vllm_run_check.check_run,
    "sglang": sglang_run_check.check_run,
}
"""Engine registry name -> its check of the run's settings (raises RolloutConfigError)."""

FAMILY_ENGINES = ("embedded",)
"""The engines that serve a family room policy (they load transformers' model in-process)."""


def check_run(run: Any) -> None:
    """The run's engine (``--rollout-engine``) checks the settings it cannot serve: its own
    check (:data:`RUN_CHECKS`), a family policy (:data:`FAMILY_ENGINES`), the SGLang servers.

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``rollout_engine``, ``policy_config``, ``hf_checkpoint``, and what each engine's
            check reads.
    Raises:
        RolloutConfigError: a setting the engine refuses (the message names the flags).
    """
    engine = run.rollout_engine
    if engine in RUN_CHECKS:
        RUN_CHECKS[engine](run)
    family = family_of(run.policy_config)
    if family and engine not in FAMILY_ENGINES:
        raise RolloutConfigError(f"--rollout-engine {engine} cannot serve the {family!r} family of "
                                 f"--hf-checkpoint {run.hf_checkpoint} (config.json field "
                                 f"'model_type'); use --rollout-engine {' or '.join(FAMILY_ENGINES)}")
    sglang_run_check.check_urls(run)
