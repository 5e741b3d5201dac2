"""Configuration of the rollout side: sampling, batch shape, task and engines.

Flag names follow slime (``--rollout-batch-size``, ``--n-samples-per-prompt``,
``--rollout-temperature``, ...); each field's flag, help and allowed range
are declared with it (:func:`replayrl.actors.settings.setting`); ``tools/run/flags.py`` builds the flags,
the config-file keys and the flag table of docs/configuration.md from them.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from replayrl.actors.settings import POSITIVE, Choices, Range, Rule, check_settings, setting
from replayrl.rollout.errors import RolloutConfigError

_MODULE_FUNCTION = Rule(lambda v: not v or ":" in v, "module:function")


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


RM_TYPES = ("digits", "exact", "math")
"""Built-in rewards (``rollout/scoring/rewards.py``): the embedded task's, normalised string equality,
math-verify's answer equivalence."""


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
        max_turns: generated turns per trajectory; > 1 enables the task's environment
            (``--rollout-max-turns``; a task without one is refused).
        task: the task's registry name (``--task``, ``replayrl.rollout.tasks.TASKS``); ``""`` =
            ``prompt_file`` with ``--prompt-data``, else ``digits``
            (``replayrl.rollout.tasks.task_name``).
        num_digits: digits per prompt of the embedded task.
        num_values: prompt digits are drawn from ``0 .. num_values - 1``.
        answer_tokens: digits in each prompt and answer of the sort task (``--answer-tokens``,
            N; the answer is N digit tokens then EOS, so N + 1 new tokens).
        dataset_size: distinct prompts in the embedded dataset.
        generate_timeout_s: seconds the manager waits for one engine call.
        custom_reward: ``module:function`` replacing the task's verifier (``--custom-reward``),
            called as ``fn(prompt_ids, response_ids, loss_mask, answer_id, config)`` with
            read-only arrays and this frozen config; must return a finite float.
        append_eos_on_truncation: end every length-capped trajectory (``finish_reason ==
            "length"``, status ``truncated``) with a synthetic EOS
            (``replayrl.rollout.traces.trajectory.append_synthetic_eos``, docs/design/traces.md#trace-arrays),
            so the policy is trained to stop (``--rollout-append-eos-on-truncation``; off by
            default). The reward is the verifier's for the response as trained, EOS included.
        env, env_timeout_s, env_failure, env_reward: your own environment (``--env``,
            ``replayrl.rollout.tasks.environment``), its per-call time limit, what a failing
            call does and where the reward comes from.
    """

    seed: int = setting(1, "seed", "seed of data, sampling and initialisation",
                        Range(0, 2 ** 32, "[)"))
    rollout_batch_size: int = setting(16, "rollout-batch-size", "prompt groups per step", Range(low=1))
    n_samples_per_prompt: int = setting(8, "n-samples-per-prompt", "trajectories per prompt group",
                                        Range(low=2, why="GRPO's group-relative advantage "
                                                        "of a single sample is 0"))
    temperature: float = setting(1.0, "rollout-temperature", "sampling temperature (the trainer "
                                 "takes logprobs of logits / T)", POSITIVE)
    top_k: int = setting(20, "rollout-top-k", "sampling top-k; the trainer normalises over the "
                         "same support", Range(low=1, also=(-1,), also_text="-1 (off)"))
    top_p: float = setting(1.0, "rollout-top-p", "sampling top-p (nucleus)", Range(0, 1, "(]"))
    min_p: float = setting(0.0, "rollout-min-p", "sampling min-p", Range(0, 1, "[)"))
    max_response_len: int = setting(2, "rollout-max-response-len", "new tokens per turn",
                                    Range(low=1))
    max_turns: int = setting(1, "rollout-max-turns", "turns per trajectory; > 1 turns on the "
                             "tool environment", Range(low=1))
    num_digits: int = setting(4, "num-digits", "digits per prompt of the embedded task", Range(low=1))
    num_values: int = setting(5, "num-values", "prompt digits are drawn from 0 .. num-values - 1",
                              Range(2, 10))
    answer_tokens: int = setting(16, "answer-tokens", "--task sort: N, the digits in each prompt "
                                 "and answer (the answer is the N digits sorted, then EOS: N + 1 "
                                 "new tokens; there --rollout-max-response-len defaults to N + 1 "
                                 "and --grpo-std-normalization to on, and the context must hold "
                                 "2 N + 5 tokens)", Range(low=1), metavar="N")
    dataset_size: int = setting(4096, check=Range(low=1))
    generate_timeout_s: float = setting(300.0, "rollout-timeout-seconds", "engine call timeout",
                                        POSITIVE)
    custom_reward: str = setting("", "custom-reward", "verifier fn(prompt_ids, response_ids, "
                                 "loss_mask, answer_id, config) replacing the task's, with "
                                 "read-only arrays and the frozen rollout config", _MODULE_FUNCTION,
                                 metavar="MODULE:FUNCTION")
    append_eos_on_truncation: bool = setting(False, "rollout-append-eos-on-truncation",
                                             "end length-capped responses with a synthetic EOS "
                                             "(trained with no behaviour ratio; scored with it)")

    task: str = setting("", "task", "the task (its prompts, reward and multi-turn environment), "
                        "a name in the registry replayrl.rollout.tasks.TASKS: digits (the "
                        "built-in digit task), sort (sort --answer-tokens digits) or "
                        "prompt_file (--prompt-data)", metavar="NAME",
                        default_text="prompt_file with --prompt-data, else digits")
    prompt_data: str = setting("", "prompt-data", "prompt file, JSONL or Parquet (one prompt "
                               "per row); empty = the built-in digit task's shipped prompts",
                               metavar="FILE", default_text="built-in digits")
    input_key: str = setting("prompt", "input-key", "row key of the prompt (text, or a list of "
                             "chat messages with --apply-chat-template)")
    label_key: str = setting("label", "label-key", "row key of the label the reward checks "
                             "(string or number)")
    metadata_key: str = setting("metadata", "metadata-key", "row key of an optional JSON "
                                "object kept with the prompt")
    num_epoch: int = setting(0, "num-epoch", "passes over the prompt data, each in a fresh "
                             "seeded order (0 = unbounded)", Range(low=0))
    tokenizer: str = setting("", "tokenizer", "checkpoint directory with tokenizer.json, "
                             "tokenizer_config.json, generation_config.json (read with "
                             "transformers' AutoTokenizer)", metavar="DIR",
                             default_text="the initial checkpoint")
    apply_chat_template: bool = setting(False, "apply-chat-template", "render prompts and tool "
                                        "observations with the tokenizer's chat template")
    apply_chat_template_kwargs: str = setting("{}", "apply-chat-template-kwargs", "extra "
                                              "apply_chat_template arguments",
                                              Rule(_json_object, "a JSON object"), metavar="JSON")
    rm_type: str = setting("digits", "rm-type", "built-in reward: digits (the embedded task), "
                           "exact (normalised text equality with the label), math (math-verify, "
                           "extra 'math')", Choices(RM_TYPES))
    reward_timeout_s: float = setting(30.0, "reward-timeout-seconds", "longest one call of "
                                      "--custom-reward or --rm-type math may take (digits and "
                                      "exact are bounded and run inline)", POSITIVE)
    reward_failure: str = setting("error", "reward-failure", "a reward that raises or times out: "
                                  "error (stop, naming the sample) or zero (score 0, counted)",
                                  Choices(("error", "zero")))
    env: str = setting("", "env", "your own multi-turn environment (tools in the chat "
                       "template's format, rollout/tasks/environment.py): module:Class or a "
                       "name in replayrl.rollout.tasks.ENVIRONMENTS; replaces the task's own environment",
                       metavar="ENV", default_text="the task's environment")
    env_timeout_s: float = setting(30.0, "env-timeout-seconds", "longest one reset or step "
                                   "call of --env may take", POSITIVE)
    env_failure: str = setting("abort", "env-failure", "an --env call that raises, times out, "
                               "answers a malformed step or an observation longer than the "
                               "context left: abort (end that trajectory, status aborted, "
                               "counted) or error (stop the run, naming prompt and turn)",
                               Choices(("abort", "error")))
    env_reward: str = setting("verifier", "env-reward", "the reward of an --env trajectory: "
                              "verifier (the task's --rm-type / --custom-reward), env (the sum "
                              "of the environment's step rewards) or sum (both added)",
                              Choices(("verifier", "env", "sum")))
    eval_prompt_data: tuple[str, ...] = setting((), "eval-prompt-data", "evaluation set NAME "
                                                "and its prompt FILE", Rule(
                                                    lambda v: len(v) % 2 == 0, "NAME FILE pairs"),
                                                metavar="NAME FILE", nargs=2)
    n_samples_per_eval_prompt: int = setting(1, "n-samples-per-eval-prompt", "samples per "
                                             "evaluation prompt (pass@k uses k = this)",
                                             Range(low=1))
    eval_temperature: float = setting(1.0, "eval-temperature", "evaluation sampling "
                                      "temperature", POSITIVE)
    eval_top_k: int = setting(-1, "eval-top-k", "evaluation sampling top-k",
                              Range(low=1, also=(-1,), also_text="-1 (off)"))
    eval_top_p: float = setting(1.0, "eval-top-p", "evaluation sampling top-p", Range(0, 1, "(]"))
    eval_max_response_len: int = setting(0, "eval-max-response-len", "new tokens per "
                                         "evaluation turn (0 = --rollout-max-response-len)",
                                         Range(low=0))

    def __post_init__(self) -> None:
        check_settings(self, RolloutConfigError)

    def sampling_dict(self) -> dict:
        """Sampling parameters as a plain dict (travels to engines)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p}

    def eval_sampling_dict(self) -> dict:
        """Evaluation sampling parameters (``--eval-temperature`` ...), as :meth:`sampling_dict`."""
        return {"temperature": self.eval_temperature, "top_k": self.eval_top_k,
                "top_p": self.eval_top_p, "min_p": 0.0}

    def eval_sets(self) -> tuple[tuple[str, str], ...]:
        """``(name, file)`` of each ``--eval-prompt-data`` pair, in order."""
        v = self.eval_prompt_data
        return tuple((v[i], v[i + 1]) for i in range(0, len(v), 2))

    def to_dict(self) -> dict:
        """All fields as a plain dict (for actor kwargs and the run record)."""
        return asdict(self)
