"""Configuration of the rollout side: sampling, batch shape, task and engines.

Flag names follow slime (``--rollout-batch-size``, ``--n-samples-per-prompt``,
``--rollout-temperature``, ...); the launcher in ``tools/`` maps flags onto these fields.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


class RolloutConfigError(ValueError):
    """An unsupported rollout setting; the message names the flag."""


@dataclass(frozen=True)
class RolloutConfig:
    """Everything the RolloutManager and engine actors need.

    Attributes:
        seed: data-source and sampling seed.
        rollout_batch_size: prompt groups per optimizer step (``--rollout-batch-size``).
        n_samples_per_prompt: trajectories per prompt group (``--n-samples-per-prompt``).
        temperature, top_k, top_p, min_p: sampling (``--rollout-temperature`` ...); ``top_k``
            -1 keeps the whole vocabulary as support.
        max_response_len: new tokens per turn (``--rollout-max-response-len``).
        max_turns: generated turns per trajectory; > 1 enables the tool environment
            (``--rollout-max-turns``).
        num_digits: digits per prompt of the embedded task.
        num_values: prompt digits are drawn from ``0 .. num_values - 1``.
        dataset_size: distinct prompts in the embedded dataset.
        generate_timeout_s: seconds the manager waits for one engine call.
        custom_reward: ``module:function`` replacing the task's verifier (``--custom-reward``),
            called as ``fn(prompt_ids, response_ids, loss_mask, answer_id, config)`` with
            read-only arrays and this frozen config; must return a finite float.
    """

    seed: int = 1
    rollout_batch_size: int = 16
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    top_k: int = 20
    top_p: float = 1.0
    min_p: float = 0.0
    max_response_len: int = 2
    max_turns: int = 1
    num_digits: int = 4
    num_values: int = 5
    dataset_size: int = 4096
    generate_timeout_s: float = 300.0
    custom_reward: str = ""

    def __post_init__(self) -> None:
        checks = [
            (self.rollout_batch_size >= 1, "--rollout-batch-size must be >= 1"),
            (self.n_samples_per_prompt >= 2, "--n-samples-per-prompt must be >= 2: GRPO's "
                                             "group-relative advantage of a single sample is 0"),
            (0 <= self.seed < 2 ** 32, "--seed must be in [0, 2**32)"),
            (self.temperature > 0, "--rollout-temperature must be > 0"),
            (self.top_k == -1 or self.top_k >= 1, "--rollout-top-k must be -1 (off) or >= 1"),
            (0 < self.top_p <= 1, "--rollout-top-p must be in (0, 1]"),
            (0 <= self.min_p < 1, "--rollout-min-p must be in [0, 1)"),
            (self.max_response_len >= 1, "--rollout-max-response-len must be >= 1"),
            (self.max_turns >= 1, "--rollout-max-turns must be >= 1"),
            (self.num_digits >= 1, "--num-digits must be >= 1"),
            (2 <= self.num_values <= 10, "--num-values must be in [2, 10]"),
            (self.dataset_size >= 1, "dataset_size must be >= 1"),
            (self.generate_timeout_s > 0, "--rollout-timeout-seconds must be > 0"),
            (not self.custom_reward or ":" in self.custom_reward,
             "--custom-reward must be module:function"),
        ]
        for ok, message in checks:
            if not ok:
                raise RolloutConfigError(message)

    def sampling_dict(self) -> dict:
        """Sampling parameters as a plain dict (travels to engines)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p}

    def to_dict(self) -> dict:
        """All fields as a plain dict (for actor kwargs and the run record)."""
        return asdict(self)
