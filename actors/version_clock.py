"""Policy versions of a run, and the rules samples must satisfy to enter an optimizer step.

``trainer_version`` counts optimizer steps applied. Each engine has the version of the weights
it last loaded. Rules (docs/design/actors.md#actor-contract):

- versions never decrease: a regression raises :class:`VersionRegression` (a failover that
  resets a counter must be loud, not silently re-admit old samples);
- an engine serves no request before its first weight load of the run (enforced by the engine
  interface itself, ``replayrl.rollout.engines.base.Engine.generate``; this clock only records loads);
- a sample generated at version ``v`` may enter a step at trainer version ``t`` only if
  ``0 <= t - v <= max_staleness`` (default 1, one-step off-policy as in slime / AReaL);
- a replacement sample of exact refill must carry exactly the preflight version.

:class:`VersionRules` holds the state and the rules with no I/O; :class:`VersionClock` is the
actor that owns one instance per run and checkpoints it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from replayrl.actors.actor import Actor
from replayrl.actors.errors import StaleSample, VersionError, VersionRegression


@dataclass
class VersionRules:
    """Version state plus the admission rules (no I/O; the actor below wraps it).

    Attributes:
        max_staleness: largest allowed ``trainer_version - sample_version`` (>= 0).
        trainer_version: optimizer steps applied so far.
        engine_versions: engine name -> weight version it last loaded.
    """

    max_staleness: int = 1
    trainer_version: int = 0
    engine_versions: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise VersionError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def set_trainer_version(self, version: int) -> None:
        """Record the trainer's version. Raises :class:`VersionRegression` if it decreases."""
        if version < self.trainer_version:
            raise VersionRegression(
                f"trainer_version would move backwards: {self.trainer_version} -> {version}")
        self.trainer_version = version

    def record_engine_load(self, engine: str, version: int) -> None:
        """Record that ``engine`` loaded weights of ``version``.

        Raises:
            VersionRegression: below the engine's previous version.
        """
        previous = self.engine_versions.get(engine)
        if previous is not None and version < previous:
            raise VersionRegression(
                f"engine {engine!r} version would move backwards: {previous} -> {version}")
        self.engine_versions[engine] = version

    def staleness_ok(self, sample_version: int, trainer_version: int | None = None) -> bool:
        """``0 <= t - v <= max_staleness`` with ``t`` = ``trainer_version`` (default: current)."""
        t = self.trainer_version if trainer_version is None else trainer_version
        return 0 <= t - sample_version <= self.max_staleness

    @staticmethod
    def replacement_ok(preflight_version: int, replacement_version: int) -> bool:
        """A refill replacement must come from exactly the preflight version."""
        return replacement_version == preflight_version

    def check_samples(self, sample_ids: Iterable[int], versions: Iterable[int]) -> None:
        """Raise :class:`StaleSample` naming every sample outside the staleness window."""
        bad = [(s, v) for s, v in zip(sample_ids, versions) if not self.staleness_ok(v)]
        if bad:
            shown = ", ".join(f"sample {s} at v{v}" for s, v in bad[:8])
            raise StaleSample(
                f"{len(bad)} sample(s) outside staleness [0, {self.max_staleness}] at trainer "
                f"version {self.trainer_version}: {shown}")

    def state_dict(self) -> dict:
        """Plain-dict state for checkpoints."""
        return {"max_staleness": self.max_staleness, "trainer_version": self.trainer_version,
                "engine_versions": dict(self.engine_versions)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "VersionRules":
        """Inverse of :meth:`state_dict`.

        Raises:
            VersionError: a field is missing or not an int, or a version is negative.
        """
        try:
            rules = cls(_version(state["max_staleness"], "max_staleness"),
                        _version(state["trainer_version"], "trainer_version"),
                        {str(k): _version(v, f"engine_versions[{k!r}]")
                         for k, v in dict(state["engine_versions"]).items()})
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, VersionError):
                raise
            raise VersionError(f"malformed clock state: {type(exc).__name__}: {exc}") from None
        return rules

    def restore(self, saved: "VersionRules") -> None:
        """Move to ``saved``'s versions under the rules of any other change: every version
        must be >= the current one (an engine this clock never saw starts fresh); the
        staleness window stays. Checks everything before changing anything.

        Raises:
            VersionRegression: a version would move backwards (nothing is changed).
        """
        trial = VersionRules(self.max_staleness, self.trainer_version, dict(self.engine_versions))
        trial.set_trainer_version(saved.trainer_version)
        for engine, version in saved.engine_versions.items():
            trial.record_engine_load(engine, version)
        self.trainer_version, self.engine_versions = trial.trainer_version, trial.engine_versions


def _version(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise VersionError(f"clock state field {what} must be an int >= 0, got {value!r}")
    return value


class VersionClock(Actor):
    """The actor that owns a run's :class:`VersionRules`; every method is ordered."""

    def __init__(self, max_staleness: int = 1) -> None:
        self.rules = VersionRules(max_staleness=max_staleness)

    async def set_trainer_version(self, version: int) -> int:
        """Record an optimizer step; returns the new trainer version."""
        self.rules.set_trainer_version(version)
        return self.rules.trainer_version

    async def record_engine_load(self, engine: str, version: int) -> None:
        """Record that ``engine`` now serves ``version``."""
        self.rules.record_engine_load(engine, version)

    async def check_samples(self, sample_ids: list[int], versions: list[int]) -> int:
        """Raise ``StaleSample`` unless every sample may enter a step now; returns ``t``."""
        self.rules.check_samples(sample_ids, versions)
        return self.rules.trainer_version

    async def check_replacements(self, preflight_version: int, sample_ids: list[int],
                                 versions: list[int]) -> None:
        """Raise ``StaleSample`` unless every replacement carries exactly ``preflight_version``."""
        bad = [(s, v) for s, v in zip(sample_ids, versions)
               if not self.rules.replacement_ok(preflight_version, v)]
        if bad:
            raise StaleSample(f"replacement samples not at preflight version {preflight_version}: "
                              + ", ".join(f"sample {s} at v{v}" for s, v in bad[:8]))

    async def state(self) -> dict:
        """The clock's state, for checkpoints and progress displays."""
        return self.rules.state_dict()

    async def load_state(self, state: dict) -> None:
        """Restore a checkpointed state: the versions continue, the staleness window does not.

        ``max_staleness`` stays the one this clock was started with, i.e. the resumed run's
        ``--max-staleness`` (what its config.json records), not the checkpoint's: a setting
        given at resume is what runs (docs/design/version-clock.md#version-clock, rule 5). The versions
        obey rule 1 like any other change: none moves backwards (:meth:`VersionRules.restore`).

        Raises:
            VersionError: a malformed state (negative or non-int versions).
            VersionRegression: a version below the clock's current one; nothing changed.
        """
        self.rules.restore(VersionRules.from_state_dict(state))
