"""The ``replayrl sft`` loop: microbatches of conversations through a trainer backend with a
cross-entropy objective, in this process.

Each step takes the next ``--batch-size`` conversations of a seeded order (a fresh permutation
of the data on every pass: :func:`batch_indices`), cuts them into ``--micro-batch-size``
microbatches, and for each calls the backend's ``forward_backward`` with the loss
``-sum(mask * logp) / T``: ``logp`` the log-probability of every response token (the backend's
training forward, the same one RL trains through, at temperature 1 and with no trace to
replay), ``mask`` the assistant-only loss mask
(:func:`replayrl.rollout.text.conversation.render_conversation`) and ``T`` the step's assistant
tokens, so the step's loss is the mean token cross-entropy over every assistant token of the
step, whatever the microbatches (as transformers' ``Trainer``, which TRL's ``SFTTrainer``
extends, divides by the label tokens of all accumulated microbatches, ``num_items_in_batch``).
Then ``clip_and_step``.

Outputs in ``--output-dir``: ``config.json``, ``metrics.jsonl`` (one row per step),
``loss.png``; checkpoints ``<--save>/step-N`` every ``--save-interval`` steps (the backend's
checkpoint plus ``sft_state.json``; ``--load`` resumes from one exactly: the same weights,
optimizer state and data order), and with ``--save-hf DIR`` a Hugging Face checkpoint
``DIR/step-N`` every ``--save-interval`` steps and after the last, which ``replayrl train
--hf-checkpoint`` loads.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.sample import Sample
from replayrl.rollout.text.tokenizer import load_tokenizer
from replayrl.tools.errors import ConfigError, SFTError
from replayrl.tools.sft.config import SFTConfig
from replayrl.tools.sft.data import SFTData, load_conversations
from replayrl.tools.sft.recorder import SFTRecorder
from replayrl.transport import strict_json

log = logging.getLogger("replayrl")

__all__ = ["SFTResult", "batch_indices", "run_sft"]

STATE_FILE = "sft_state.json"
"""The file of an SFT checkpoint that says where the data order continues."""


@dataclass(frozen=True)
class SFTResult:
    """What :func:`run_sft` wrote.

    Attributes:
        metrics_path: ``metrics.jsonl``; plot_path: ``loss.png``; summary: the summary line.
        hf_dirs: every ``--save-hf`` directory written, in order.
        data: the conversations and the rows skipped.
    """

    metrics_path: Path
    plot_path: Path
    summary: str
    hf_dirs: tuple[Path, ...]
    data: SFTData


def batch_indices(step: int, batch_size: int, rows: int, seed: int) -> np.ndarray:
    """The conversations of step ``step``: positions ``step * batch_size ..`` of the endless
    sequence made of one permutation of ``range(rows)`` per pass over the data (pass ``e``:
    ``numpy.random.default_rng([seed, e]).permutation(rows)``), so a resumed run draws what the
    uninterrupted run would have.

    Returns:
        int64 ``[batch_size]`` row indices.
    """
    out = np.empty(batch_size, dtype=np.int64)
    for j in range(batch_size):
        epoch, at = divmod(step * batch_size + j, rows)
        out[j] = _permutation(seed, epoch, rows)[at]
    return out


@functools.lru_cache(maxsize=4)  # a step reads one pass's order, or two where a pass ends
def _permutation(seed: int, epoch: int, rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(rows)


def _samples(data: SFTData, indices: np.ndarray) -> list[Sample]:
    """The conversations as samples (rollout logprobs 0: SFT reads none)."""
    out = []
    for i, index in enumerate(indices):
        c = data.conversations[int(index)]
        out.append(Sample(sample_id=i, group_id=i, rollout_id=0, policy_version=0,
                          prompt_ids=c.prompt_ids, response_ids=c.response_ids,
                          loss_mask=c.loss_mask,
                          rollout_logprobs=np.zeros(len(c.response_ids), np.float32)))
    return out


def _collate(samples: list[Sample], packed: bool):
    from replayrl.trainer.batching.batch import collate, collate_packed

    return collate_packed(samples) if packed else collate(samples)


def train_step(backend, samples: list[Sample], micro_batch_size: int, packed: bool,
               clip: float) -> dict:
    """One optimizer step over ``samples``: the token-mean cross-entropy of their loss tokens.

    Returns:
        ``{"loss", "loss_tokens", "sure_token_share", "grad_norm"}``: the mean negative logprob
        (nats) over the step's loss tokens, their number, the share of them the policy gives a
        probability above 1/2 (each such token is its argmax: a lower bound of TRL's
        ``mean_token_accuracy``), and the gradient norm before clipping (L2, before this
        step's update).

    Raises:
        SFTError: the gradient norm is not finite (nothing was applied).
    """
    import torch

    tokens = int(sum(int(s.loss_mask.sum()) for s in samples))
    backend.zero_grad()
    total, sure = 0.0, 0
    for start in range(0, len(samples), micro_batch_size):
        batch = _collate(samples[start:start + micro_batch_size], packed)
        mask = batch.loss_mask

        def loss_fn(logprobs: torch.Tensor) -> torch.Tensor:
            return -(logprobs * mask.to(logprobs.device)).sum() / max(tokens, 1)

        out = backend.forward_backward(batch, loss_fn)
        logprobs = out.logprobs.cpu()
        total += float(-(logprobs * mask).sum())
        sure += int(((logprobs > np.log(0.5)) & (mask > 0)).sum())
    grad_norm = backend.clip_and_step(clip)
    if not np.isfinite(grad_norm):
        raise SFTError(f"gradient norm {grad_norm}: nothing was applied")
    return {"loss": total / max(tokens, 1), "loss_tokens": tokens,
            "sure_token_share": sure / max(tokens, 1), "grad_norm": grad_norm}


def _save(backend, config: SFTConfig, step: int) -> None:
    """The checkpoint after ``step`` steps: ``step-N.partial`` renamed when complete."""
    path = Path(config.save_dir) / f"step-{step}"
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    backend.save_checkpoint(partial, step)
    (partial / STATE_FILE).write_text(strict_json.dumps(
        {"next_step": step, "seed": config.trainer.seed, "batch_size": config.batch_size}))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(partial, path)


def _resume(backend, config: SFTConfig) -> int:
    """Restore ``--load``; the step to continue from.

    Raises:
        ConfigError: not an SFT checkpoint, or one taken under another --seed / --batch-size
            (its data order would not continue).
    """
    path = Path(config.load)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"--load {path}: not a replayrl sft checkpoint (no {STATE_FILE})")
    state = strict_json.loads((path / STATE_FILE).read_text())
    for key, flag, now in (("seed", "--seed", config.trainer.seed),
                           ("batch_size", "--batch-size", config.batch_size)):
        if state[key] != now:
            raise ConfigError(f"--load {path}: saved under {flag} {state[key]}, this run has "
                              f"{now}; the data order would not continue")
    backend.load_checkpoint(path)
    return int(state["next_step"])


def run_sft(config: SFTConfig, started: float | None = None) -> SFTResult:
    """Run ``replayrl sft`` (see the module docstring).

    Args:
        started: ``time.perf_counter()`` at the command's start (the summary's start-up).

    Raises:
        ConfigError / replayrl.rollout.errors.PromptDataError (ConversationError): bad settings
            or data, before anything trains. SFTError: a step that cannot train.
    """
    from replayrl.trainer.backends import resolve_backend

    started = time.perf_counter() if started is None else started
    tokenizer = load_tokenizer(config.hf_checkpoint, apply_chat_template=True)
    policy = read_hf_config(config.hf_checkpoint)
    # a conversation the model has no positions for cannot be forwarded: a bad row too
    data = load_conversations(config.data, tokenizer,
                              max_length=min(config.max_length, policy.max_position_embeddings),
                              vocab_size=policy.vocab_size, skip_bad_rows=config.skip_bad_rows)
    for where, message in data.skipped:
        log.warning("replayrl sft: skipped %s", message if message.startswith(where) else
                    f"{where}: {message}")
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(strict_json.dumps(strict_json.finite_or_none(config.to_dict()),
                                                      indent=2))
    backend = resolve_backend(config.trainer.train_backend)(config.hf_checkpoint, config.trainer, [])
    first = _resume(backend, config) if config.load else 0
    skipped = {"bad_rows_skipped": len(data.skipped),
               **{f"bad_rows_skipped/{r}": n for r, n in sorted(data.skipped_by_reason.items())}}
    hf_dirs = []
    with SFTRecorder(out, config.num_steps, show_progress=config.progress, config=config,
                     resume_step=first if config.load else None) as recorder:
        for step in range(first, config.num_steps):
            began = time.perf_counter()
            samples = _samples(data, batch_indices(step, config.batch_size,
                                                   len(data.conversations), config.trainer.seed))
            row = train_step(backend, samples, config.trainer.micro_batch_size,
                             config.trainer.use_packing, config.trainer.clip_grad)
            interval = config.save_interval and (step + 1) % config.save_interval == 0
            if interval:
                _save(backend, config, step + 1)
            if config.save_hf and (interval or step + 1 == config.num_steps):
                hf_dirs.append(Path(config.save_hf) / f"step-{step + 1}")
                backend.save_hf(hf_dirs[-1])
            recorder.record({"step": step, **row, "conversations": len(samples),
                             "epoch": step * config.batch_size / len(data.conversations),
                             "lr": config.trainer.lr, **skipped,
                             "step_seconds": time.perf_counter() - began})
        plot = recorder.plot()
        summary = recorder.summary(time.perf_counter() - started)
    return SFTResult(recorder.path, plot, summary, tuple(hf_dirs), data)
