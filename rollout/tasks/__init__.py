"""The task room: one interface (:mod:`replayrl.rollout.tasks.base`), its implementations, one registry.

Adding a task = one module in this package implementing :class:`Task` plus one line in
:data:`TASKS`; ``--task NAME`` selects it. The registry holds ``"module:Class"`` strings, so
importing this package imports no task class's module (only the interface and the built-in
``--rm-type`` rewards, which every task may use). Environments (``--env``,
``rollout/tasks/environment.py``, the interface only is imported) have their registry beside
it, :data:`ENVIRONMENTS`. The launcher resolves the run's task name here, in its own process,
and hands the class path to the rollout manager; a test may register a fake task by adding an
entry before the run is configured.
"""
from __future__ import annotations

from pathlib import Path

from replayrl.actors.registry import LazyRegistry
from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.errors import TaskConfigError, UnknownTask
from replayrl.rollout.tasks.base import Environment, RewardCall, Task, TaskPrompts
from replayrl.rollout.tasks.environment import ToolEnvironment

__all__ = [
    "TASKS",
    "UnknownTask",
    "task_name",
    "task_class_path",
    "load_task_class",
    "make_task",
    "Task",
    "TaskConfigError",
    "TaskPrompts",
    "RewardCall",
    "Environment",
    "ENVIRONMENTS",
    "ToolEnvironment",
    "load_environment_class",
]

# registry name -> "package.module:ClassName" of a Task subclass
TASKS = LazyRegistry(
    {
        "digits": "replayrl.rollout.tasks.digits:DigitsTask",  # the built-in digit puzzle
        "prompt_file": "replayrl.rollout.tasks.prompt_file:PromptFileTask",  # --prompt-data FILE
        "sort": "replayrl.rollout.tasks.sort:SortTask",  # sort the prompt's --answer-tokens digits
    },
    base=Task,
    unknown=lambda name, known: UnknownTask(f"unknown task {name!r}; known tasks: {known}"),
    invalid=lambda _, why: TaskConfigError(f"task class {why}"))


_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "environments"

# registry name -> "package.module:ClassName" or "path/to/file.py:ClassName" of a
# ToolEnvironment subclass (--env NAME); --env also takes such a path directly
ENVIRONMENTS = LazyRegistry(
    {
        "digit_calculator": "replayrl.rollout.tasks.calculator:DigitCalculatorEnv",
        "python_calculator": f"{_EXAMPLES / 'python_calculator.py'}:PythonCalculatorEnv",
        "retrieval": f"{_EXAMPLES / 'retrieval.py'}:RetrievalEnv",
    },
    base=ToolEnvironment, paths=True,
    unknown=lambda spec, known: TaskConfigError(f"--env {spec!r}: not a registered environment "
                                                f"({known}) nor module:Class"),
    invalid=lambda spec, why: TaskConfigError(f"--env {spec}: {why}"))


def load_environment_class(spec: str) -> type[ToolEnvironment]:
    """The :class:`ToolEnvironment` subclass ``--env spec`` names: a name of
    :data:`ENVIRONMENTS`, ``"module:Class"``, or ``"path/to/file.py:Class"``.

    Raises:
        TaskConfigError: not registered and not of those forms, not importable, or not a
            :class:`ToolEnvironment` subclass (names ``--env`` and the value).
    """
    return ENVIRONMENTS.resolve(spec)


def task_name(config: RolloutConfig) -> str:
    """The run's task: ``--task``, else what the other flags imply (``prompt_file`` with
    ``--prompt-data``, ``digits`` without)."""
    return config.task or ("prompt_file" if config.prompt_data else "digits")


def task_class_path(name: str) -> str:
    """The ``"module:Class"`` path registered under ``name``.

    Raises:
        UnknownTask: ``name`` is not registered (names it and lists the known tasks).
    """
    return TASKS.path(name)


def load_task_class(path: str) -> type[Task]:
    """Import the :class:`Task` subclass named by ``path`` (``"module:Class"``).

    Raises:
        TaskConfigError: not importable, or not a :class:`Task` subclass (names the path).
    """
    return TASKS.load(path)


def make_task(config: RolloutConfig, path: str = "") -> Task:
    """The run's task, built from ``config``: the class at ``path``, or (``""``) the one
    registered under :func:`task_name`.

    Raises:
        UnknownTask, TaskConfigError: as :func:`task_class_path`, :func:`load_task_class` and
            the task's constructor (settings it cannot run with).
    """
    return load_task_class(path or task_class_path(task_name(config)))(config)
