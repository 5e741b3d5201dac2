"""The run's torch work before the actors start, done in a short child process so the launcher
never imports torch (a torch runtime is ~200 MiB RSS held for the whole
run: VmRSS after ``import torch``, torch 2.13 CPU).

Five things need torch there: checking the engine class (the embedded engine's module imports
torch), resolving ``--device`` (torch sees the CUDA devices, or refuses ``cuda`` where there is
none) and ``--engine-dtype auto`` (torch reads the device's capability), writing the
embedded default checkpoint (the model is built and initialised by torch) and resolving which
transformers class reads the tokenizer (``AutoTokenizer``'s import chain loads torch in
transformers 5). The launcher runs them in a fresh child (:func:`in_child` of
:func:`replayrl.tools.run.launcher.write_initial_files`), which also checks the prompt data with
the tokenizer it loaded and returns the results (:class:`Resolved`); the rollout manager then
reads the tokenizer with that class, without torch (:mod:`replayrl.rollout.text.tokenizer_class`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from replayrl.actors.child_process import run_in_child
from replayrl.actors.process_title import set_process_title

T = TypeVar("T")


@dataclass(frozen=True)
class Resolved:
    """What the launcher hands its actors that only a process with torch can work out.

    Attributes:
        engine_class: the engine's ``"module:Class"``, checked against the run
            (:func:`replayrl.tools.run.launcher.check_engine`).
        engine_dtype: ``--engine-dtype`` with ``auto`` resolved for this machine's CPU
            (:func:`replayrl.rollout.engines.precision.resolve_dtype`).
        tokenizer_class: the class the rollout manager reads the tokenizer with
            (:func:`replayrl.rollout.text.tokenizer_class.resolve_tokenizer_class`).
        device: ``--device`` resolved for this machine, ``"cpu"`` or ``"cuda"``
            (:func:`replayrl.actors.device.resolve_device_kind`).
        cuda_devices: the CUDA devices visible to the launcher (0 on the CPU), which
            :func:`replayrl.tools.run.launcher.actor_specs` shares out among the actor processes.
    """

    engine_class: str
    engine_dtype: str
    tokenizer_class: str
    device: str = "cpu"
    cuda_devices: int = 0


def _title_child() -> None:
    """Name the child ``rrl:initial_files`` (cut to 15 characters by the kernel), so ``ps`` and
    ``replayrl bench memory`` tell it from the launcher."""
    set_process_title("initial_files", "launcher")


def in_child(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a fresh child process (:func:`replayrl.actors.child_process.run_in_child`),
    which exits when it returns (with its torch runtime); ``fn`` is a module-level function,
    ``args`` and the result pickle.

    Raises:
        whatever ``fn`` raised; ``replayrl.actors.errors.ActorDied`` when the child died
        without an answer.
    """
    return run_in_child(fn, *args, initializer=_title_child)
