"""Exact refill: the coordinator against the shared cases, fail-closed steps, resume equality."""
from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest
import torch

from replayrl.actors import Directory, RemoteError, Supervisor
from replayrl.actors.errors import StaleSample
from replayrl.actors.version_clock import VersionRules
from replayrl.rollout.sample import Sample, samples_to_columns
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, launch, write_initial_checkpoint
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import RefillExhausted, TrainerConfigError
from replayrl.trainer.ranks.proximal_cache import ProximalLogprobCache
from replayrl.trainer.rejection.refill import RefillCoordinator
from replayrl.trainer.rejection.rs_policy import RSGate
from tests.fakes import FakeProxy
from tests.paths import CASES

CASE = json.loads((CASES / "refill_admission.json").read_text())


def _sample(sample_id: int, group_id: int, version: int, accept: bool) -> Sample:
    # logp_prox will be 0 for every token; rollout logprob -2 makes exp(d) = e^2 (rejected by
    # a sequence band [0.5, 2]); rollout logprob 0 makes the weight exactly 1 (accepted).
    lp = 0.0 if accept else -2.0
    return Sample(sample_id=sample_id, group_id=group_id, rollout_id=0, policy_version=version,
                  prompt_ids=np.array([1, 3], np.int32), response_ids=np.array([5], np.int32),
                  loss_mask=np.array([1], np.uint8), rollout_logprobs=np.array([lp], np.float32))


class FakeTrainer:
    """What a coordinator is given (cache, preflight, manager / clock proxies, version), with canned
    replacement rounds."""

    def __init__(self, rounds: list[list[list[bool]]], version: int = 7,
                 replacement_version: int | None = None) -> None:
        self.cache = ProximalLogprobCache()
        self.version = version
        self.rules = VersionRules()
        self.requested: list[int] = []
        next_id = [100]

        async def generate_replacements(n_groups, min_version):
            assert min_version == version  # served at the preflight version, or later
            self.requested.append(n_groups)
            groups = rounds[len(self.requested) - 1]
            assert len(groups) == n_groups
            out = []
            for g in groups:
                gid = next_id[0]
                for ok in g:
                    out.append(_sample(next_id[0] * 10 + len(out), gid, replacement_version
                                       if replacement_version is not None else version, ok))
                next_id[0] += 1
            return samples_to_columns(out)

        async def check_replacements(preflight_version, ids, versions):
            bad = [s for s, v in zip(ids, versions) if not self.rules.replacement_ok(preflight_version, v)]
            if bad:
                raise StaleSample(f"replacement samples not at preflight version: {bad}")

        self.manager = FakeProxy(generate_replacements=generate_replacements)
        self.clock = FakeProxy(check_replacements=check_replacements)

    async def preflight(self, samples):
        for s in samples:
            self.cache.put(s.sample_id, torch.zeros(len(s.response_ids)))
        return {}


def _initial(groups: dict[str, list[bool]]) -> list[Sample]:
    samples = []
    for g, oks in enumerate(groups.values()):
        samples += [_sample(g * 10 + i, g, 7, ok) for i, ok in enumerate(oks)]
    return samples


def _coordinator(trainer, max_rounds: int, refill: bool = True) -> RefillCoordinator:
    cfg = TrainerConfig(rs_mode="sequence", rs_lower=0.5, rs_upper=2.0, rs_batch_refill=refill,
                        rs_refill_max_rounds=max_rounds)
    c = CASE["config"]
    return RefillCoordinator(cfg.rs_gate, cfg, c["rollout_batch_size"], c["n_samples_per_prompt"],
                             cache=trainer.cache, preflight=trainer.preflight, manager=trainer.manager,
                             clock=trainer.clock, version=trainer.version)


async def test_case_one_group_rejected_is_replaced_whole():
    trainer = FakeTrainer(rounds=[[[True, True]]])
    initial = _initial(CASE["initial_groups"])
    await trainer.preflight(initial)
    admitted, token_accept, metrics = await _coordinator(trainer, CASE["config"]["max_rounds"]).admit(initial)
    assert trainer.requested == [CASE["expected"]["replacement_groups_requested"]]
    # A (group 0) admitted; B (group 1) dropped whole; the replacement group fills the deficit
    assert sorted({s.group_id for s in admitted}) == [0, 100]
    assert len(admitted) == 4 and metrics["admitted_groups"] == 2 and metrics["rejected_groups"] == 1
    # only admitted entries stay in the cache, one per training sample
    trainer.cache.check_bijection([s.sample_id for s in admitted])


async def test_case_exhaustion_raises_and_leaves_only_what_the_caller_clears():
    rounds = [[oks] for oks in CASE["exhaustion"]["replacement_rounds"]]
    trainer = FakeTrainer(rounds=[[[False, False]], [[False, False]]])
    assert len(rounds) == CASE["config"]["max_rounds"]
    initial = _initial(CASE["initial_groups"])
    await trainer.preflight(initial)
    with pytest.raises(RefillExhausted, match="1 of 2 prompt groups admitted after 2"):
        await _coordinator(trainer, CASE["config"]["max_rounds"]).admit(initial)
    assert trainer.requested == [1, 1]


async def test_replacement_from_another_version_is_rejected():
    trainer = FakeTrainer(rounds=[[[True, True]]], version=7, replacement_version=6)
    initial = _initial(CASE["initial_groups"])
    await trainer.preflight(initial)
    with pytest.raises(StaleSample, match="preflight version"):
        await _coordinator(trainer, 2).admit(initial)


async def test_refill_off_masks_rejected_tokens_and_keeps_every_sample():
    trainer = FakeTrainer(rounds=[])
    initial = _initial(CASE["initial_groups"])
    await trainer.preflight(initial)
    admitted, token_accept, metrics = await _coordinator(trainer, 2, refill=False).admit(initial)
    assert [s.sample_id for s in admitted] == [s.sample_id for s in initial]
    assert [bool(token_accept[s.sample_id].all()) for s in initial] == [True, True, True, False]
    assert metrics["rs_sample_accept_rate"] == 0.75 and trainer.requested == []
    assert not [k for k in metrics if k.startswith("refill_")]  # no replacements, no refill keys


# ---- the replacements' replay rates, through the real preflight -------------------------


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the trainer backend sets the process's threads


def _traced_sample(model, sample_id, group_id, rollout_lp, rng, perturb_rows=()):
    """A sample whose engine traces are the model's own choices from a single-sample forward
    (independent of the trainer's batching), with the LAST MoE layer's experts replaced at
    ``perturb_rows``: that layer's MLP feeds no router or indexer, so only those rows drift."""
    prompt, response = rng.integers(0, 40, 4).astype(np.int32), rng.integers(0, 40, 3).astype(np.int32)
    tokens = torch.from_numpy(np.r_[prompt, response][:-1].astype(np.int64))[None]
    with torch.no_grad():
        out = model(tokens, torch.arange(tokens.shape[1])[None], capture=True)
    experts = out.routed_experts[0].numpy().astype(np.int32).copy()
    for t in perturb_rows:
        experts[t, -1] = (experts[t, -1] + 1) % model.config.num_experts  # another expert set
    return Sample(sample_id=sample_id, group_id=group_id, rollout_id=0, policy_version=0,
                  prompt_ids=prompt, response_ids=response, loss_mask=np.ones(3, np.uint8),
                  rollout_logprobs=np.full(3, rollout_lp, np.float32), routed_experts=experts,
                  indexer_topk=out.indexer_topk[0].numpy().astype(np.int32))


async def test_replacement_replay_rates_are_reported(tmp_path, _restore_threads):
    from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
    from replayrl.trainer.ranks.trainer_actor import TrainerActor

    config = build_config({"n-samples-per-prompt": 2, "rollout-batch-size": 1})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    cfg = TrainerConfig(use_support_replay=False, rs_mode="sequence", rs_lower=1e-30,
                        rs_upper=1e30, rs_batch_refill=True)
    actor = TrainerActor(str(checkpoint), cfg.to_dict(), n_samples_per_prompt=2, engines=[],
                         rollout_batch_size=1, vocab_tokens=list(VOCABULARY))
    model, rng = actor.backend.model, np.random.default_rng(0)
    # rollout logprob +30 per token: exp(sum d) ~ e^-100 is below the band, the group is dropped;
    # rollout logprob 0: exp(sum logp_prox) ~ e^-11 is inside it, the replacement is admitted
    initial = [_traced_sample(model, i, 0, 30.0, rng) for i in range(2)]
    repl = [_traced_sample(model, 10, 1, 0.0, rng, perturb_rows=(0, 4)),
            _traced_sample(model, 11, 1, 0.0, rng, perturb_rows=(2,))]
    step_rates = actor.preflight(initial)

    async def generate_replacements(n_groups, min_version):
        assert n_groups == 1 and min_version == 0
        return samples_to_columns(repl)

    async def check_replacements(version, ids, versions):
        assert version == 0 and versions == [0, 0]

    coordinator = RefillCoordinator(
        actor.gate, actor.config, 1, 2, cache=actor.cache, preflight=actor.preflight_ranks,
        manager=FakeProxy(generate_replacements=generate_replacements),
        clock=FakeProxy(check_replacements=check_replacements), version=0)
    admitted, _, metrics = await coordinator.admit(initial)
    assert [s.sample_id for s in admitted] == [10, 11]
    # by hand: 3 perturbed (token, layer) rows of (6 + 6) tokens x 3 MoE layers with a trace
    n_moe = len(model.config.moe_layers)
    assert metrics["refill_routing_drift_rate"] == pytest.approx(3 / (12 * n_moe), abs=1e-12)
    assert metrics["refill_routing_flip_rate"] == 0.0  # the replay used the engine's experts
    assert metrics["refill_indexer_flip_rate"] == 0.0 and metrics["refill_indexer_drift_rate"] == 0.0
    # the step's own keys are the initial samples' (unperturbed) rates, not mixed with these
    assert step_rates["routing_drift_rate"] == [0.0]
    assert {k for k in metrics if k.startswith("refill_") and k.endswith("_rate")} == {
        "refill_routing_flip_rate", "refill_routing_drift_rate",
        "refill_indexer_flip_rate", "refill_indexer_drift_rate"}


def test_gate_flags_fail_closed():
    with pytest.raises(TrainerConfigError, match="--rs-mode"):
        RSGate("tokens")
    with pytest.raises(TrainerConfigError, match="--rs-lower"):
        RSGate("sequence", 2.0, 1.0)
    with pytest.raises(ValueError, match="--rs-batch-refill needs --rs-mode"):
        TrainerConfig(rs_batch_refill=True)
    with pytest.raises(ValueError, match="--dp-size"):
        TrainerConfig(dp_size=0)


# ---- the real multi-process system --------------------------------------------------------
SMALL = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "progress": False}


async def _digest_after_failed_step(tmp_path, extra: dict, trainer_cls: str | None = None):
    config = build_config({**SMALL, "num-steps": 1, "output-dir": str(tmp_path), **extra})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    specs = actor_specs(config, checkpoint)
    if trainer_cls:
        import dataclasses
        specs = [dataclasses.replace(s, cls=trainer_cls) if s.name == "trainer" else s for s in specs]
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        directory = Directory.for_run(run_dir, [s.name for s in specs])
        async with Supervisor(specs, directory, run_dir):
            trainer = directory.ref("trainer")
            await trainer.call("push_weights")
            before = await trainer.call("weights_digest")
            await directory.ref("rollout_manager").call("generate", 0)
            with pytest.raises(RemoteError) as info:
                await trainer.call("train", 0)
            after = await trainer.call("weights_digest")
            clock = await directory.ref("version_clock").call("state")
            state = await trainer.call("state")
    return info.value, before, after, clock, state


async def test_band_rejecting_everything_fails_before_the_optimizer_step(tmp_path):
    # exp(d) = 1 exactly is impossible for a bf16 engine vs an fp32 trainer: nothing passes
    err, before, after, clock, state = await _digest_after_failed_step(
        tmp_path, {"rs-mode": "sequence", "rs-lower": 1.0, "rs-upper": 1.0, "rs-batch-refill": True,
                   "rs-refill-max-rounds": 1})
    assert err.remote_type == "RefillExhausted" and "refusing the optimizer step" in str(err)
    assert before == after  # weights and optimizer moments bitwise unchanged
    assert clock["trainer_version"] == 0 and state["version"] == 0


async def test_failure_between_preflight_and_update_applies_nothing(tmp_path):
    # --preflight always: with the defaults the proximal logprobs come from the training forward
    err, before, after, clock, state = await _digest_after_failed_step(
        tmp_path, {"preflight": "always"}, trainer_cls="tests.failing_trainer:FailBeforeUpdate")
    assert "killed between preflight and update" in str(err)
    assert before == after and clock["trainer_version"] == 0 and state["version"] == 0


async def test_refill_keeps_the_batch_exact_on_the_real_system(tmp_path):
    config = build_config({**SMALL, "num-steps": 3, "output-dir": str(tmp_path), "rs-mode": "geometric",
                           "rs-lower": 0.9, "rs-upper": 1.1, "rs-batch-refill": True,
                           "rs-refill-max-rounds": 8})
    result = await launch(config)
    assert [r["admitted_groups"] for r in result.rows] == [2, 2, 2]
    assert [r["trained_groups"] for r in result.rows] == [2, 2, 2]


async def test_resumed_run_draws_the_same_next_batch(tmp_path):
    base = {**SMALL, "num-steps": 4, "save-interval": 2}
    full = await launch(build_config({**base, "output-dir": str(tmp_path / "full")}))
    ckpt = tmp_path / "full" / "checkpoints" / "step-2"
    assert (ckpt / "run_state.json").exists() and (ckpt / "model" / "model.safetensors").exists()
    resumed = await launch(build_config({**base, "save-interval": 0, "load": str(ckpt),
                                         "output-dir": str(tmp_path / "resumed")}))
    assert [r["step"] for r in resumed.rows] == [2, 3]
    assert resumed.rows[0]["prompt_indices"] == full.rows[2]["prompt_indices"]
    assert resumed.rows[1]["prompt_indices"] == full.rows[3]["prompt_indices"]
    assert resumed.rows[0]["trainer_version"] == full.rows[2]["trainer_version"] == 3
