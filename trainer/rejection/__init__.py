"""Rejection sampling (RS) and exact refill: what decides which samples a step trains on.

* :mod:`replayrl.trainer.rejection.rs_gates` -- the token / sequence / geometric gate formulas on
  ``d = logp_prox - logp_rollout`` and group-atomic admission;
* :mod:`replayrl.trainer.rejection.rs_policy` -- :class:`~replayrl.trainer.rejection.rs_policy.RSGate`, the run's
  gate (``--rs-mode``), applied identically by the preflight and the training forward;
* :mod:`replayrl.trainer.rejection.refill_planner` -- the refill quantum and the rounds of one step
  (pure bookkeeping, no I/O);
* :mod:`replayrl.trainer.rejection.dynamic_sampling` -- which prompt groups carry a learning
  signal (rewards not all equal; ``--dynamic-sampling``), pure;
* :mod:`replayrl.trainer.rejection.refill` -- :class:`~replayrl.trainer.rejection.refill.RefillCoordinator`,
  which drives the planner against the RolloutManager and the VersionClock.

docs/design/trainer-math.md#trainer-math and docs/design/rejection-sampling.md#exact-refill.
"""
