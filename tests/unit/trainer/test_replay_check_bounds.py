"""The preflight replay check takes its bounds from the settings, each kind its own: routing
(``--replay-min-overlap-ratio`` / ``--replay-max-mismatch-fraction``) and the indexer
(``--indexer-replay-min-overlap-ratio`` / ``--indexer-replay-max-mismatch-fraction``), defaults
(0, 1) that never fail (docs/configuration.md) -- no threshold is a constant of the code.

Run through :meth:`RankStep.replay_rates`, the call every backend's preflight makes, on choices
built by hand: routing differs from the engine's on 3 of 10 tokens, the indexer on 6 of 10."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from replayrl.rollout.model import default_config
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.ranks.rank_step import RankStep
from replayrl.trainer.replay.checks import ReplayMismatch

T = 10
MODEL = default_config(32)  # MoE layers 1-3 (top-2 of 8 experts), indexer on layers 1 and 3


def _choices(layers: int, k: int, differ: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(engine, own)`` int32 ``[1, T, layers, k]``: the engine picks ``0..k-1`` on every row;
    the trainer's own choice swaps one of them for ``k`` on the last layer of the tokens in
    ``differ`` (overlap ``(k - 1) / k`` there, 1 elsewhere)."""
    engine = torch.arange(k, dtype=torch.int32).expand(1, T, layers, k).clone()
    own = engine.clone()
    own[0, differ, -1, 0] = k
    return engine, own


def _step(**settings) -> tuple[RankStep, SimpleNamespace, SimpleNamespace]:
    backend = SimpleNamespace(device=torch.device("cpu"), model_config=MODEL)
    routing, own_routing = _choices(len(MODEL.moe_layers), MODEL.num_experts_per_tok, [0, 4, 9])
    index, own_index = _choices(len(MODEL.indexed_layers), MODEL.index_topk, [1, 2, 3, 5, 6, 7])
    batch = SimpleNamespace(routed_experts=routing, indexer_topk=index,
                            key_padding_mask=torch.ones(1, T, dtype=torch.bool))
    out = SimpleNamespace(routed_experts=routing, own_routed_experts=own_routing,
                          indexer_topk=index, own_indexer_topk=own_index, support_entropy=None)
    return RankStep(backend, TrainerConfig(**settings)), batch, out


def test_the_defaults_never_fail_and_report_the_drift():
    step, batch, out = _step()
    assert TrainerConfig().replay_bounds("routing") == TrainerConfig().replay_bounds("indexer") == (0.0, 1.0)
    assert not TrainerConfig().replay_check_on
    rates: dict = {}
    step.replay_rates(rates, batch, out)
    assert rates["routing_drift_rate"] == [pytest.approx(3 / 10 / 3)]  # 3 of 30 (token, layer) rows
    assert rates["indexer_drift_rate"] == [pytest.approx(6 / 10 / 2)]
    assert rates["routing_flip_rate"] == rates["indexer_flip_rate"] == [0.0]


@pytest.mark.parametrize("settings,message", [
    (dict(replay_max_mismatch_fraction=0.25), r"routing replay mismatch: .* 3/10 tokens .* "
                                               r"\(allowed <= 0\.25\)"),
    (dict(indexer_replay_max_mismatch_fraction=0.5), r"indexer replay mismatch: .* 6/10 tokens "
                                                     r".* \(allowed <= 0\.5\)"),
    # the seed's hard-coded 0.7, now a setting: an indexer row keeping 7 of its 8 keys passes
    # it (below), a stricter bound fails
    (dict(indexer_replay_min_overlap_ratio=0.9), r"indexer replay mismatch: min per-token "
                                                 r"overlap 0\.875 \(allowed >= 0\.9\)"),
])
def test_each_kind_fails_on_its_own_bound_from_the_settings(settings, message):
    step, batch, out = _step(**settings)
    assert step.config.replay_check_on  # the trainer runs the preflight for it
    with pytest.raises(ReplayMismatch, match=message):
        step.replay_rates({}, batch, out)


@pytest.mark.parametrize("settings", [
    dict(replay_max_mismatch_fraction=0.35),  # routing 0.3 passes; the indexer's 0.6 is not
    dict(indexer_replay_max_mismatch_fraction=0.65, indexer_replay_min_overlap_ratio=0.7),
    dict(replay_min_overlap_ratio=0.5, replay_max_mismatch_fraction=0.3),  # judged by its own bound
])
def test_a_bound_applies_to_its_own_kind_only(settings):
    step, batch, out = _step(**settings)
    rates: dict = {}
    step.replay_rates(rates, batch, out)
    assert set(rates) >= {"routing_drift_rate", "indexer_drift_rate"}


def test_bounds_are_checked_and_a_kind_must_exist():
    with pytest.raises(TrainerConfigError, match="indexer-replay-min-overlap-ratio"):
        TrainerConfig(indexer_replay_min_overlap_ratio=1.5)
    with pytest.raises(TrainerConfigError, match="no replay check of kind 'support'"):
        TrainerConfig().replay_bounds("support")
