"""A synthetic EOS has no behaviour logprob: it enters no RS gate, no TIS weight and no
|rollout - trainer logprob| metric (docs/design/traces.md#trace-arrays, docs/design/trainer-math.md#trainer-math,
docs/design/rejection-sampling.md#rejection-sampling), and the run can produce one
(``--rollout-append-eos-on-truncation``). Every expected value is a naive float64 loop here."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.dispatch.manager import RolloutManager
from replayrl.rollout.engines.base import Generation
from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.episodes.turn_loop import Episode
from replayrl.rollout.sample import TRACE_FIELDS, Sample
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY, DigitTask
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.traces.trajectory import SYNTHETIC_EOS_LOGPROB, append_synthetic_eos, merge_turns
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import launch, write_initial_checkpoint
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.loss.losses import policy_loss
from replayrl.trainer.rejection.refill import RefillCoordinator
from replayrl.trainer.rejection.rs_policy import RSGate
from tests.fakes import FakeProxy

TASK = DigitTask()
EOS = TASK.eos_id
LOWER, UPPER = 0.9, 1.1
TIS_CAP = 2.0


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the trainer backend sets the process's threads


def _geometric_weight(prox, rollout, rows) -> float:
    """exp(mean over ``rows`` of prox - rollout), float64, one token at a time."""
    total = 0.0
    for t in rows:
        total += float(prox[t]) - float(rollout[t])
    return math.exp(total / max(len(rows), 1))


@pytest.fixture(scope="module")
def on_policy(tmp_path_factory):
    """Twelve length-capped samples from an fp32 engine holding the trainer's own weights."""
    from replayrl.trainer.ranks.trainer_actor import TrainerActor

    before = torch.get_num_threads()
    config = build_config({"n-samples-per-prompt": 4, "rollout-batch-size": 3, "progress": False})
    checkpoint = write_initial_checkpoint(config, tmp_path_factory.mktemp("ckpt"))
    cfg = TrainerConfig(rs_mode="geometric", rs_lower=LOWER, rs_upper=UPPER, tis_cap=TIS_CAP)
    actor = TrainerActor(str(checkpoint), cfg.to_dict(), n_samples_per_prompt=4, engines=[],
                         rollout_batch_size=3, vocab_tokens=list(VOCABULARY))
    engine = EmbeddedEngine(actor.backend.model_config, dtype=torch.float32)
    engine.load_weights(actor.backend.weights(), version=0)
    rng = np.random.default_rng(0)
    prompts = [TASK.make_prompt(rng)[0] for _ in range(48)]
    gens = engine.generate([p.tolist() for p in prompts], SamplingParams(top_k=config.rollout.top_k),
                           max_new_tokens=3, eos_token_id=EOS, seed=5, traces=TRACE_FIELDS)
    capped = [(p, g) for p, g in zip(prompts, gens) if g.finish_reason == "length"][:12]
    assert len(capped) == 12
    samples = [Sample(sample_id=i, group_id=i // 4, rollout_id=0, policy_version=0, prompt_ids=p,
                      status="truncated", **merge_turns(p, [g], [], sample_id=i).sample_fields())
               for i, (p, g) in enumerate(capped)]
    torch.set_num_threads(before)
    return actor, samples


async def _admit(actor, samples):
    actor.cache.clear()
    actor.preflight(samples)
    coordinator = RefillCoordinator(actor.gate, actor.config, 3, 4, cache=actor.cache,
                                    preflight=actor.preflight_ranks, manager=FakeProxy(),
                                    clock=FakeProxy(), version=0)
    admitted, token_accept, metrics = await coordinator.admit(samples)
    prox = {s.sample_id: actor.cache.peek(s.sample_id).double().numpy() for s in samples}
    return admitted, token_accept, metrics, prox


async def test_twelve_on_policy_capped_samples_pass_geometric_rs_before_and_after_the_eos(
        on_policy, _restore_threads):
    actor, capped = on_policy
    _, _, before, prox = await _admit(actor, capped)
    for s in capped:  # the naive reference: every sampled token, on-policy
        w = _geometric_weight(prox[s.sample_id], s.rollout_logprobs, range(len(s.response_ids)))
        assert LOWER <= w <= UPPER and abs(w - 1.0) < 1e-4
    assert before["rs_sample_accept_rate"] == 1.0  # 12 of 12

    eos = [append_synthetic_eos(s, EOS) for s in capped]
    admitted, token_accept, after, prox = await _admit(actor, eos)
    assert after["rs_sample_accept_rate"] == 1.0 and len(admitted) == 12  # still 12 of 12
    assert all(bool(token_accept[s.sample_id].all()) for s in eos)
    for s in eos:
        R = len(s.response_ids)
        assert s.rollout_logprobs[-1] == SYNTHETIC_EOS_LOGPROB
        assert list(s.sampled_mask) == [1] * (R - 1) + [0]
        ok = _geometric_weight(prox[s.sample_id], s.rollout_logprobs, range(R - 1))
        assert LOWER <= ok <= UPPER
        # the input really is the defect's: with the placeholder row counted every sample fails
        bad = _geometric_weight(prox[s.sample_id], s.rollout_logprobs, range(R))
        assert not LOWER <= bad <= UPPER


async def test_synthetic_row_has_tis_weight_one_and_no_logprob_diff(on_policy, _restore_threads):
    actor, capped = on_policy
    eos = [append_synthetic_eos(s, EOS) for s in capped]
    _, _, _, prox_by_id = await _admit(actor, eos)
    batch = collate(eos, routing=False, indexer=False, support=True)
    prox = torch.cat([actor.cache.peek(s.sample_id) for s in eos])
    adv = torch.from_numpy(np.repeat(np.linspace(-1, 1, 12), [len(s.response_ids) for s in eos]))
    logp = (prox.double() + 0.05 * torch.sin(torch.arange(len(prox), dtype=torch.float64)))
    loss, m = policy_loss(logp, prox, batch.rollout_logprobs, adv.float(), batch.loss_mask,
                          eps_low=0.2, eps_high=0.28, tis_cap=TIS_CAP,
                          sampled_mask=batch.sampled_mask, denominator="loss_tokens")

    total = weights = diffs = 0.0
    n_loss = n_sampled = 0
    old_eos_weights = []
    t = 0
    for s in eos:
        R = len(s.response_ids)
        for j in range(R):
            lp, pr, ro, a = float(logp[t]), float(prox[t]), float(s.rollout_logprobs[j]), float(adv[t])
            r = math.exp(lp - pr)
            synthetic = j == R - 1
            w = 1.0 if synthetic else min(math.exp(pr - ro), TIS_CAP)
            total += -w * min(r * a, min(max(r, 0.8), 1.28) * a)
            n_loss += 1
            if synthetic:
                old_eos_weights.append(min(math.exp(pr - ro), TIS_CAP))  # from the placeholder
            else:
                n_sampled += 1
                weights += w
                diffs += abs(pr - ro)
            t += 1
    assert float(loss) == pytest.approx(total / n_loss, rel=1e-6, abs=1e-9)
    assert m["tis_weight_mean"] == pytest.approx(weights / n_sampled, rel=1e-6)
    assert m["logprob_abs_diff_mean"] == pytest.approx(diffs / n_sampled, rel=1e-5, abs=1e-9)
    assert m["sampled_tokens"] == n_sampled == n_loss - 12
    assert max(old_eos_weights) < 0.5  # what the placeholder would have given (about 0.03-0.1)

    # the placeholder is never read: any value there, NaN included, gives the same loss
    poisoned = batch.rollout_logprobs.clone()
    poisoned[batch.sampled_mask == 0] = float("nan")
    poisoned[batch.loss_mask == 0] = float("nan")
    loss2, m2 = policy_loss(logp, prox, poisoned, adv.float(), batch.loss_mask, eps_low=0.2,
                            eps_high=0.28, tis_cap=TIS_CAP, sampled_mask=batch.sampled_mask,
                            denominator="loss_tokens")
    assert torch.equal(loss, loss2) and m == m2


def test_gates_leave_the_synthetic_row_out_of_sums_and_counts():
    s = append_synthetic_eos(Sample(sample_id=3, group_id=0, rollout_id=0, policy_version=0,
                                    prompt_ids=np.array([1, 4], np.int32),
                                    response_ids=np.array([5, 6], np.int32),
                                    loss_mask=np.ones(2, np.uint8),
                                    rollout_logprobs=np.array([-1.0, -2.0], np.float32)), EOS)
    prox = torch.tensor([-1.05, -1.9, -3.5])  # d = -0.05, +0.1 at the sampled rows
    roll = torch.from_numpy(np.array(s.rollout_logprobs))
    mask = [torch.from_numpy(np.array(s.sampled_mask))]
    seq = math.exp(-0.05 + 0.1)
    geo = math.exp((-0.05 + 0.1) / 2)
    for mode, lo, hi, expect in (("sequence", seq - 1e-4, seq + 1e-4, True),
                                 ("geometric", geo - 1e-4, geo + 1e-4, True),
                                 ("token", math.exp(-0.05) - 1e-4, math.exp(0.1) + 1e-4, True),
                                 ("token", math.exp(-0.05) + 1e-4, math.exp(0.1) + 1e-4, False)):
        accept, tokens = RSGate(mode, lo, hi).decide([prox], [roll], mask)
        assert accept == [expect], mode
        if mode == "token":
            assert tokens[0].tolist() == [expect, True, True]  # the synthetic row has no ratio


PROMPT = (TASK.bos_id, VOCABULARY.index("max"), VOCABULARY.index("3"), VOCABULARY.index("1"),
          VOCABULARY.index("="))


def _episode(response: list[int], finish: str) -> Episode:
    gen = Generation(response_ids=np.array(response, np.int32),
                     rollout_logprobs=np.full(len(response), -0.5, np.float32),
                     finish_reason=finish, sample_support=None, routed_experts=None,
                     indexer_topk=None)
    return Episode(PROMPT, (gen,), (), (0,), finish, 0)


@pytest.mark.parametrize("flag", [False, True])
async def test_manager_appends_the_eos_to_capped_trajectories_and_scores_the_trained_response(
        flag, tmp_path):
    cfg = RolloutConfig(append_eos_on_truncation=flag, max_response_len=1)
    checkpoint = write_initial_checkpoint(build_config({}), tmp_path / "ckpt")  # its tokenizer
    manager = RolloutManager(cfg.to_dict(), ["engine_0"], [], 256, str(checkpoint),
                             len(VOCABULARY))
    digit3, answer = VOCABULARY.index("3"), VOCABULARY.index("3")
    prompt = Prompt(0, np.array(PROMPT, np.int32), answer)

    async def scored(kw):
        return Sample(**kw, reward=await manager._reward(kw["sample_id"], prompt,
                                                         kw["response_ids"], kw["loss_mask"]))

    capped = await scored(manager._assemble(_episode([digit3], "length"), prompt, 0, 0))
    stopped = await scored(manager._assemble(_episode([digit3, EOS], "stop"), prompt, 0, 0))
    assert capped.status == "truncated" and stopped.status == "completed"
    assert not stopped.synthetic_eos and stopped.reward == 1.0  # exact digit, then <eos>
    if flag:
        # the task scores "3 <eos>" as a stopped exact answer: 0.5 ** 0 * 1.0
        assert capped.synthetic_eos and capped.response_ids.tolist() == [digit3, EOS]
        assert capped.loss_mask.tolist() == [1, 1] and capped.sampled_mask.tolist() == [1, 0]
        assert capped.reward == 1.0
    else:
        assert not capped.synthetic_eos and capped.response_ids.tolist() == [digit3]
        assert capped.reward == 0.5  # not stopped: halved


async def test_short_run_trains_synthetic_eos_samples_end_to_end(tmp_path):
    config = build_config({"rollout-batch-size": 4, "n-samples-per-prompt": 4, "progress": False,
                           "num-steps": 2, "output-dir": str(tmp_path),
                           "rollout-append-eos-on-truncation": True, "rs-mode": "geometric",
                           "rs-lower": LOWER, "rs-upper": UPPER})
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["synthetic_eos_samples"] > 0 and 0 < r["synthetic_eos_fraction"] <= 1
        assert r["sampled_tokens"] == r["loss_tokens"] - r["synthetic_eos_samples"]
        for key in ("grad_norm", "tis_weight_mean", "clipfrac", "train_rollout_logprob_abs_diff"):
            assert np.isfinite(r[key]), key
    # step 0 is on-policy (bf16 engine, fp32 trainer): the placeholder row would have rejected
    # every capped sample and put |log p(eos)| into the logprob diff; neither happens
    assert rows[0]["rs_sample_accept_rate"] == 1.0
    assert 0 < rows[0]["train_rollout_logprob_abs_diff"] < 0.05
    assert 0.9 < rows[0]["tis_weight_mean"] < 1.1
