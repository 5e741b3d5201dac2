"""Dispatch: the RolloutManager actor that turns prompt groups into scored trajectories, the
engine actor that hosts a rollout engine in its own process, the pool of engines the manager
sends groups to, and the pause / resume gate of the rollout side."""
