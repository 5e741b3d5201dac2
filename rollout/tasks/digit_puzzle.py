"""The embedded synthetic verifiable task: answer a question about a short list of digits.

A prompt is ``<bos> op d1 d2 ... dn =`` and the correct response is one digit then ``<eos>``.
``op`` is ``max`` (largest digit), ``min`` (smallest) or ``first`` (the first digit), so the
policy has to read both the operator and the digits. A randomly initialised model rarely
produces a well-formed answer, so the initial reward is low but non-zero.

Reward (in [0, 1]), verifiable from the tokens alone: ``0.5 ** |guess - answer|`` for a first
token that is a digit, halved unless ``<eos>`` follows it immediately, 0 for anything else. The
distance term keeps the signal dense: an exact-match-only reward leaves a tiny model guessing
the most frequent answer (measured: reward stuck near 0.2 for 400 steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replayrl.rollout.errors import TaskError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
OPERATORS = ("max", "min", "first", "last")
DIGITS = tuple(str(d) for d in range(10))
# Filler letters make the initial search space larger than the answer set, so a random policy
# rarely produces a well-formed answer and the reward starts near zero.
FILLER = tuple(chr(c) for c in range(ord("a"), ord("z") + 1))
VOCABULARY = SPECIAL_TOKENS + DIGITS + OPERATORS + ("=",) + FILLER
_TOKEN_ID = {t: i for i, t in enumerate(VOCABULARY)}  # built once: reward() runs per sample


@dataclass(frozen=True)
class DigitTask:
    """Prompt generator and reward function of the embedded task.

    Attributes:
        num_digits: digits per prompt (prompt length = num_digits + 3 tokens).
        num_values: prompt digits are drawn from ``0 .. num_values - 1`` (the answer space).
        operators: which operators prompts may use (subset of ``OPERATORS``).
    """

    num_digits: int = 4
    operators: tuple[str, ...] = OPERATORS
    num_values: int = 10

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise TaskError(f"num_digits must be >= 1, got {self.num_digits}")
        if not 2 <= self.num_values <= 10:
            raise TaskError(f"num_values must be in [2, 10], got {self.num_values}")
        unknown = set(self.operators) - set(OPERATORS)
        if not self.operators or unknown:
            raise TaskError(f"operators must be a non-empty subset of {OPERATORS}, got {self.operators}")

    vocabulary = VOCABULARY

    @property
    def token_id(self) -> dict[str, int]:
        """Token string -> id (a new dict: the caller may change it)."""
        return dict(_TOKEN_ID)

    @property
    def pad_id(self) -> int:
        return VOCABULARY.index("<pad>")

    @property
    def bos_id(self) -> int:
        return VOCABULARY.index("<bos>")

    @property
    def eos_id(self) -> int:
        return VOCABULARY.index("<eos>")

    def make_prompt(self, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        """Draw one prompt.

        Returns:
            ``(prompt_ids int32[num_digits + 3], answer_token_id)``.
        """
        op = self.operators[int(rng.integers(len(self.operators)))]
        digits = rng.integers(0, self.num_values, size=self.num_digits)
        answer = {"max": digits.max(), "min": digits.min(), "first": digits[0],
                  "last": digits[-1]}[op]
        ids = self.token_id
        prompt = [ids["<bos>"], ids[op], *(ids[str(d)] for d in digits), ids["="]]
        return np.asarray(prompt, dtype=np.int32), ids[str(int(answer))]

    def reward(self, response_ids: np.ndarray, answer_id: int) -> float:
        """Reward in [0, 1] of a response (int token ids) for a prompt whose answer is ``answer_id``.

        ``0.5 ** |guess - answer|`` when the first token is a digit (1.0 when exact), halved
        unless the response stops right after it with ``<eos>``; 0.0 when it is not a digit
        (also a token beyond the task's vocabulary). Raises TaskError for a negative id.
        """
        ids = _TOKEN_ID
        if len(response_ids) and int(response_ids[0]) < 0:
            raise TaskError(f"token id {int(response_ids[0])} is negative")
        # a policy from --hf-checkpoint may have a larger vocabulary than the task: a token
        # beyond the task's is a model token that is not a digit, i.e. a wrong answer
        if (len(response_ids) == 0 or int(response_ids[0]) >= len(VOCABULARY)
                or VOCABULARY[int(response_ids[0])] not in DIGITS):
            return 0.0
        distance = abs(int(VOCABULARY[int(response_ids[0])]) - int(VOCABULARY[answer_id]))
        stopped = len(response_ids) == 2 and int(response_ids[1]) == ids["<eos>"]
        return 0.5 ** distance * (1.0 if stopped else 0.5)

    def decode(self, ids: np.ndarray) -> str:
        """Token ids as a space-separated string (for logs and the REPL).

        Raises:
            TaskError: an id outside the vocabulary.
        """
        bad = [int(i) for i in ids if not 0 <= int(i) < len(VOCABULARY)]
        if bad:
            raise TaskError(f"token ids outside the vocabulary (size {len(VOCABULARY)}): {bad}")
        return " ".join(VOCABULARY[int(i)] for i in ids)
