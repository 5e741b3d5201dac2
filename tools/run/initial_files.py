"""The run's torch work before the actors start, done in a short child process so the launcher
never imports torch (issue 24, memory: a torch runtime is ~250 MiB RSS held for the whole run).

Four things need torch there: checking the engine class (the embedded engine's module imports
torch), resolving ``--engine-dtype auto`` (torch reads the CPU's capability), writing the
embedded default checkpoint (the model is built and initialised by torch) and resolving which
transformers class reads the tokenizer (``AutoTokenizer``'s import chain loads torch in
transformers 5). :func:`initial_files` runs them in a ``spawn`` child and returns the results
(:class:`Resolved`); the launcher and the rollout manager then read the tokenizer with that
class, without torch (:mod:`replayrl.rollout.tokenizer_class`).
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from replayrl.tools.run.config import RunConfig


@dataclass(frozen=True)
class Resolved:
    """What the launcher hands its actors that only a process with torch can work out.

    Attributes:
        engine_class: the engine's ``"module:Class"``, checked against the run
            (:func:`replayrl.tools.run.launcher.check_engine`).
        engine_dtype: ``--engine-dtype`` with ``auto`` resolved for this machine's CPU
            (:func:`replayrl.rollout.engines.precision.resolve_dtype`).
        tokenizer_class: the class the rollout manager reads the tokenizer with
            (:func:`replayrl.rollout.tokenizer_class.resolve_tokenizer_class`).
    """

    engine_class: str
    engine_dtype: str
    tokenizer_class: str


def write_initial_files(config: RunConfig, engine: str, checkpoint: Path | None,
                        tokenizer: Path) -> Resolved:
    """In this process: check the engine class ``engine`` (``"module:Class"``), resolve the
    engine dtype, write the embedded default checkpoint to ``checkpoint`` (None: the run has
    one, ``--hf-checkpoint``), then resolve the tokenizer class of ``tokenizer``.

    Returns:
        :class:`Resolved`; its ``tokenizer_class`` is ``"auto"`` when the directory does not load
        here, so the launcher's own check reports the error.

    Raises:
        replayrl.tools.errors.ConfigError: as :func:`replayrl.tools.run.launcher.check_engine`.
    """
    from replayrl.rollout.engines.precision import resolve_dtype
    from replayrl.rollout.tokenizer_class import AUTO, resolve_tokenizer_class
    from replayrl.tools.run.launcher import check_engine, write_initial_checkpoint

    check_engine(config, engine)
    dtype = resolve_dtype(config.engine_dtype)
    if checkpoint is not None:
        write_initial_checkpoint(config, checkpoint)
    try:
        tokenizer_class = resolve_tokenizer_class(tokenizer)
    except Exception:  # reported, with the flag, by check_prompt_data's load
        tokenizer_class = AUTO
    return Resolved(engine, dtype, tokenizer_class)


def initial_files(config: RunConfig, engine: str, checkpoint: Path | None, tokenizer: Path) -> Resolved:
    """:func:`write_initial_files` in a ``spawn`` child process, which exits when it returns
    (with its torch runtime); its exceptions are raised here.

    Returns:
        as :func:`write_initial_files`.
    """
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(write_initial_files, config, engine, checkpoint, tokenizer).result()
