"""On one batch, with the same weights and samples, replayrl's update equals TRL's.

`replayrl bench peer` claims both sides train the same objective (its settings table). This
holds it on the tiny embedded model: TRL 1.16's `GRPOTrainer.compute_loss` (loss_type "dapo",
on-policy, no KL) on transformers' `Qwen3MoeForCausalLM` loaded from the same checkpoint-init,
then torch's AdamW as TRL builds it, against replayrl's trainer update (routing and indexer
replay of the model's own choices, full-vocabulary logprobs, TIS at ratio 1): every
parameter's gradient and the AdamW step agree to float32 rounding. Support replay is left out on
purpose: it normalises over the sampler's top-k candidates, the sampling policy's own
distribution, which TRL's full-vocabulary logprob does not (docs/benchmarks.md#peer).
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from replayrl.rollout.sample import Sample  # noqa: E402
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY  # noqa: E402
from replayrl.tools.bench.peer import SAME_OBJECTIVE, run_config, trl_settings  # noqa: E402
from replayrl.tools.run.launcher import write_initial_checkpoint  # noqa: E402
from replayrl.trainer.config import TrainerConfig  # noqa: E402
from replayrl.trainer.ranks.trainer_actor import TrainerActor  # noqa: E402

N = 4  # samples per prompt
PROMPTS = [[1, 16, 7, 5, 7, 6, 17], [1, 14, 4, 6, 6, 5, 17]]
# responses of 1 and 2 tokens (2 = <eos>), rewards set by hand with a spread in each group
RESPONSES = [[5, 2], [6, 2], [9], [5, 30], [4, 2], [2], [4, 4], [7, 2]]
REWARDS = [1.0, 0.5, 0.0, 0.25, 1.0, 0.0, 0.5, 0.125]


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _hf_grad(grads: dict, name: str, layer_experts: dict) -> torch.Tensor:
    """TRL's gradient in replayrl's parameter layout (transformers fuses the experts)."""
    if ".mlp.experts." not in name:
        return grads[name]
    prefix, rest = name.split(".mlp.experts.")
    e, proj = int(rest.split(".")[0]), rest.split(".")[1]
    gate_up, down = grads[f"{prefix}.mlp.experts.gate_up_proj"], grads[f"{prefix}.mlp.experts.down_proj"]
    inter = layer_experts["intermediate"]
    return {"gate_proj": gate_up[e, :inter], "up_proj": gate_up[e, inter:], "down_proj": down[e]}[proj]


def test_replayrl_update_equals_trls_on_one_batch(tmp_path, _restore_threads):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    config = run_config(1, 1, str(tmp_path / "out"), {**SAME_OBJECTIVE, "rollout-batch-size": 2,
                                                      "n-samples-per-prompt": N})
    checkpoint = write_initial_checkpoint(config, tmp_path / "checkpoint-init")
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))

    trainer = TrainerConfig(**{**config.trainer.to_dict(), "use_support_replay": False})
    actor = TrainerActor(str(checkpoint), trainer.to_dict(), n_samples_per_prompt=N, engines=[],
                         rollout_batch_size=len(PROMPTS), vocab_tokens=list(VOCABULARY))
    model = actor.backend.model
    samples = []
    for i, (response, reward) in enumerate(zip(RESPONSES, REWARDS)):
        prompt = np.array(PROMPTS[i // N], np.int32)
        ids = torch.tensor(np.r_[prompt, response], dtype=torch.long)[None]
        with torch.no_grad():  # behaviour logprobs from transformers: the TIS ratio is 1
            logits = hf(ids).logits[0, len(prompt) - 1:-1]
            behaviour = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
            own = model(ids[:, :-1], torch.arange(ids.shape[1] - 1)[None], capture=True)
        samples.append(Sample(
            sample_id=i, group_id=i // N, rollout_id=0, policy_version=0, prompt_ids=prompt,
            response_ids=np.array(response, np.int32), loss_mask=np.ones(len(response), np.uint8),
            rollout_logprobs=behaviour.numpy(), reward=reward,
            routed_experts=own.routed_experts[0].numpy().astype(np.int32),
            indexer_topk=own.indexer_topk[0].numpy().astype(np.int32)))

    ours: dict[str, torch.Tensor] = {}
    step = actor.backend.clip_and_step

    def keep_grads(max_norm):
        ours.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return step(max_norm)

    actor.backend.clip_and_step = keep_grads
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    accept = {s.sample_id: torch.ones(len(s.response_ids), dtype=torch.bool) for s in samples}
    metrics = asyncio.run(actor._update(samples, accept, fused=True))

    settings = {**trl_settings(config), "max_steps": 1}
    trl = GRPOTrainer(model=hf, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                      args=GRPOConfig(output_dir=str(tmp_path / "trl"), **settings),
                      train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}), processing_class=tokenizer)
    trl.create_optimizer_and_scheduler(num_training_steps=1)
    trl.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which is not run here
    width = max(map(len, RESPONSES))
    completion = torch.zeros((len(RESPONSES), width), dtype=torch.long)
    mask = torch.zeros_like(completion)
    for i, r in enumerate(RESPONSES):
        completion[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    rewards = torch.tensor(REWARDS)
    advantages = rewards - rewards.view(-1, N).mean(1).repeat_interleave(N)  # scale_rewards="none"
    prompt_ids = torch.tensor([PROMPTS[i // N] for i in range(len(RESPONSES))])
    hf.train()
    loss = trl.compute_loss(hf, {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
                                 "completion_ids": completion, "completion_mask": mask,
                                 "advantages": advantages, "num_items_in_batch": mask.sum()})
    loss.backward()
    theirs = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), settings["max_grad_norm"])
    hf_before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    trl.optimizer.step()

    experts = {"intermediate": config.policy_config.moe_intermediate_size}
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert set(ours) == {n for n, _ in model.named_parameters() if ".indexer." not in n}
    for name, grad in ours.items():
        torch.testing.assert_close(grad, _hf_grad(theirs, name, experts), rtol=1e-4, atol=1e-7,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")
    hf_params = dict(hf.named_parameters())
    hf_step = {n: hf_params[n].detach() - hf_before[n] for n in hf_params}
    # an AdamW step is about lr per element; where a gradient is as small as eps (1e-6) the step
    # g / (|g| + eps) magnifies rounding, so the bound is 0.5 % of lr there
    lr = config.trainer.lr
    for name, p in model.named_parameters():
        if name not in ours:
            continue
        torch.testing.assert_close(p.detach() - before[name], _hf_grad(hf_step, name, experts),
                                   rtol=1e-3, atol=5e-3 * lr,
                                   msg=lambda m, name=name: f"AdamW step of {name}: {m}")
