"""Configuration of the trainer side: optimizer, loss, replays, timeouts.

Each field's flag, help and allowed range are declared with it
(:func:`replayrl.actors.settings.setting`); ``tools/run/flags.py`` builds the flags, the config-file keys and
the flag table of docs/configuration.md from them. Conditions on two fields stay in ``__post_init__``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from replayrl.actors.device import DEVICES
from replayrl.actors.settings import POSITIVE, Choices, Range, check_settings, setting
from replayrl.trainer.backends import BACKENDS
from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.rejection.rs_settings import check_rs_settings

if TYPE_CHECKING:  # rs_policy imports torch; the settings load in processes without it
    from replayrl.trainer.rejection.rs_policy import RSGate


FULL_WEIGHTS_LR = 3e-4
"""The AdamW learning rate of a full-weight run (``--lr`` not given)."""
LORA_LR = 1e-3
"""The AdamW learning rate of a LoRA run (``--lr`` not given): about three times the full-weight
rate. The adapters start from ``B = 0`` and train few parameters, so LoRA recipes (slime, verl,
TRL) raise the rate, often ten-fold; on the embedded model ten-fold (3e-3) was unstable and 1e-3
learned best with and without the LM head adapted (docs/benchmarks.md#lora)."""


@dataclass(frozen=True)
class TrainerConfig:
    """Everything the TrainerActor needs besides the model.

    Attributes:
        lr, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad: AdamW (``--lr`` ...).
        eps_clip, eps_clip_high: PPO clip range ``[1 - eps_clip, 1 + eps_clip_high]``.
        tis_cap: TIS weight cap ``C`` (``--tis-cap``); ``None`` disables TIS.
        entropy_coef: the entropy bonus ``beta`` of :func:`replayrl.trainer.loss.losses.policy_loss`
            (``--entropy-coef``; docs/design/trainer-math.md#entropy-collapse); with
            ``entropy_target`` the ceiling of the adaptive coefficient.
        entropy_baseline: the bonus's reward is centred on the step's mean surprisal (opt-in)
            (:func:`replayrl.trainer.loss.entropy_baseline.mean_surprisal`, ``--entropy-baseline``;
            docs/design/trainer-math.md#entropy-baseline).
        entropy_target, entropy_coef_step: adaptive entropy control
            (:class:`replayrl.trainer.loss.entropy_control.EntropyControl`; ``--entropy-target``
            0 = the fixed ``entropy_coef``).
        entropy_coef_warmup_steps: the bonus's linear warmup in trained steps
            (``--entropy-coef-warmup-steps``; docs/design/trainer-math.md#entropy-warmup).
        normalize_advantage_std: GRPO divides by the group std (``--grpo-std-normalization``).
        micro_batch_size: samples per forward/backward (gradient accumulation).
        temperature: the rollout temperature (logprobs are of ``logits / temperature``).
        use_routing_replay, use_indexer_replay, use_support_replay: R3, indexer replay and
            support-replay logprobs (``--use-routing-replay`` ...).
        replay_min_overlap_ratio, replay_max_mismatch_fraction: the preflight routing replay
            check (``--replay-min-overlap-ratio`` / ``--replay-max-mismatch-fraction``): the
            engine's experts against the trainer's own router's choice, per token; the
            defaults (0, 1) never fail. A step that violates them raises before training,
            listing mismatches.
        indexer_replay_min_overlap_ratio, indexer_replay_max_mismatch_fraction: the same check
            of the engine's indexer key slots against the trainer's own indexer top-k, with
            bounds of its own (``--indexer-replay-*``; defaults (0, 1): never fail): indexer
            rows differ more than routing rows even at equal precision (ties in the scores).
        dsa_indexer_loss_coeff: megatron-core's DSA indexer KL loss coefficient on the megatron
            trainer (``--dsa-indexer-loss-coeff``; 0: the indexer stays frozen;
            docs/design/megatron.md#megatron-families).
        indexer_drift_interval: the training forward without a preflight computes the
            model's own indexer top-k (whose only use under indexer replay is the
            ``indexer_drift_rate`` metric) on every N-th update of the rank, the first included;
            the others skip it (``indexer_drift_rate`` null) and cost less: 7 % of a 1m x 64
            step (docs/benchmarks.md). A preflight (the replay check, RS, refill) computes it
            every step. Only the embedded model's torch / FSDP backends skip it
            (``--indexer-drift-interval``).
        use_packing: each microbatch is one packed row (``--use-packing``) built from one
            :class:`replayrl.trainer.batching.packing.PackedLayout`, instead of right-padded rows.
        logprobs_chunk_size: > 0 uses the fused chunked LM-head path for support replay
            (``--logprobs-chunk-size``; peak memory bounded by the chunk, not N x V).
        preflight: ``auto`` runs the separate preflight forward only when the RS gate, exact
            refill or the replay check need the proximal logprobs before the update (otherwise
            they are the detached logprobs of the training forward); ``always`` runs it anyway.
        rpc_timeout_s: seconds any trainer-initiated actor call may take.
        torch_threads: intra-op threads of the trainer process.
        backward_threads: intra-op threads of the backward passes (0: ``torch_threads``). The
            backward runs last in a step, mostly while the engines wait for the next weights, so
            on a host shared with them it can use their cores. The gradients may then differ from
            a ``torch_threads`` backward by float rounding (a reduction split between threads),
            the same from run to run (``--trainer-backward-threads``).
        trace_decode_threads: threads decoding a batch's ``"sets"`` trace columns (the indexer
            top-k keys; ``replayrl.rollout.sample.samples_from_columns``'s ``decode_threads``);
            the decoded arrays do not depend on it (``--trace-decode-threads``).
        seed: torch seed of the trainer process.
        device: ``auto``, ``cpu`` or ``cuda`` (``--device``, set with the run's field of the
            same name): where the torch and fsdp backends place the policy, its optimizer state
            and every batch (:func:`replayrl.actors.device.process_device`: this rank's CUDA
            device); the megatron backend trains on the CPU (docs/gpu.md).
        rs_mode, rs_lower, rs_upper: the RS gate (``--rs-mode none|token|sequence|geometric``).
        rs_denominator: loss denominator when RS rejects tokens without refill
            (``loss_tokens`` | ``accepted_tokens``), see :mod:`replayrl.trainer.rejection.rs_policy`.
        stop_on_empty_step: a step with nothing to train (no accepted loss token, or no prompt
            group with two accepted samples) raises :class:`replayrl.trainer.ranks.trainer_actor.EmptyStep`
            and ends the run (``--stop-on-empty-step``); off, the step is skipped (nothing
            moves, the row says ``skipped: 1``) and the run goes on.
        rs_batch_refill: exact refill (``--rs-batch-refill``): train on exactly
            ``rollout_batch_size`` admitted groups or do not step.
        rs_refill_max_rounds: replacement rounds before the step fails.
        rs_refill_max_candidate_cache_bytes: byte cap of the proximal-logprob cache.
        rs_refill_rpc_timeout_s: timeout of every actor call on the refill path.
        dynamic_sampling: DAPO dynamic sampling (``--dynamic-sampling``): a prompt group whose
            rewards are all equal is dropped and refilled by exact refill, so every step trains
            on exactly ``rollout_batch_size`` groups with differing rewards or fails before the
            optimizer step (:mod:`replayrl.trainer.rejection.dynamic_sampling`).
        lora_rank, lora_alpha, lora_target_modules: LoRA through peft (``--lora-rank``, 0 =
            off; :mod:`replayrl.trainer.lora.peft_adapter`, docs/design/lora.md#lora).
        train_backend: the model-owning backend, a name in :data:`replayrl.trainer.backends.BACKENDS`
            (``--train-backend``).
        dp_size: data-parallel trainer ranks (``--dp-size``; docs/design/trainer-ranks.md#trainer-ranks):
            each trains a contiguous, equal share of every batch, and the refill
            quantum makes every replacement batch split evenly over them.
        tp_size, ep_size, pp_size: the megatron trainer's tensor-, expert- and
            pipeline-parallel sizes (``--tp-size`` / ``--ep-size`` / ``--pp-size``;
            docs/design/megatron.md#pipeline-parallel).
        cp_size: the megatron trainer's context-parallel size (``--cp-size``; docs/design/megatron.md#context-parallel):
            each rank of a CP group holds
            2 of ``2 x cp_size`` chunks of every row. The trainer has ``dp_size x tp_size x
            pp_size x cp_size`` ranks; CP ranks are not data-parallel ranks (they train the
            same share).
        vpp_size, microbatch_group_size: the virtual pipeline layout of the refill quantum;
            the megatron backend runs its stages without the interleaved (VPP) schedule, so
            ``vpp_size`` is 1.
    """

    lr: float = setting(0.0, "lr", "AdamW learning rate; 0 = the run's default: 3e-4 for full "
                        "weights, 1e-3 with --lora-rank (docs/design/lora.md#lora)",
                        Range(low=0, closed="()", also=(0.0,), also_text="0 (the run's default)"),
                        default_text="3e-4; 1e-3 with --lora-rank")
    weight_decay: float = setting(0.0, "weight-decay", "AdamW weight decay", Range(low=0))
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = setting(1e-6, "adam-eps", "AdamW epsilon (denominator floor: bounds the step "
                              "after a run of near-zero gradients)", POSITIVE)
    clip_grad: float = setting(1.0, "clip-grad", "gradient-norm clip", POSITIVE)
    eps_clip: float = setting(0.2, "eps-clip", "PPO clip low: ratio >= 1 - eps", Range(0, 1, "()"))
    eps_clip_high: float = setting(0.28, "eps-clip-high", "PPO clip high: ratio <= 1 + eps", POSITIVE)
    tis_cap: float | None = setting(2.0, "tis-cap", "TIS weight cap C",
                                    Range(low=0, closed="()", also=(None,)))
    entropy_coef: float = setting(0.05, "entropy-coef", "entropy bonus beta: each token's "
                                  "advantage gains -beta x its logprob (score-function "
                                  "entropy gradient; 0 = off; with --entropy-target the "
                                  "largest coefficient; see --entropy-baseline)", Range(low=0))
    entropy_baseline: bool = setting(False, "entropy-baseline", "subtract beta x the step's "
                                     "mean surprisal from each token's entropy reward (a REINFORCE "
                                     "baseline: learns faster early, but stalled a 50m run on "
                                     "the EOS plateau)")
    entropy_target: float = setting(0.0, "entropy-target", "adaptive entropy control: the bonus "
                                    "only while the entropy (metric surprisal_mean) is below "
                                    "this many nats, its coefficient moved by "
                                    "--entropy-coef-step per step (Skywork-OR1; 0 = a fixed "
                                    "--entropy-coef)", Range(low=0))
    entropy_coef_step: float = setting(0.005, "entropy-coef-step", "adaptive entropy control: "
                                       "the coefficient's change per optimizer step", POSITIVE)
    entropy_coef_warmup_steps: int = setting(0, "entropy-coef-warmup-steps", "the entropy "
                                             "bonus's coefficient rises linearly over this many "
                                             "trained steps, beta x k / N at the k-th (0 = the "
                                             "whole bonus from the first step)", Range(low=0))
    normalize_advantage_std: bool = setting(False, "grpo-std-normalization",
                                            "divide GRPO advantages by the group std")
    micro_batch_size: int = setting(128, "micro-batch-size", "samples per forward/backward",
                                    Range(low=1))
    temperature: float = setting(1.0, "rollout-temperature", check=POSITIVE)
    use_routing_replay: bool = setting(True, "use-routing-replay", "R3: replay the engine's MoE routing")
    use_indexer_replay: bool = setting(True, "use-indexer-replay", "replay the indexer's top-k keys")
    use_support_replay: bool = setting(True, "use-support-replay",
                                       "logprobs over the sampler's support")
    logprobs_chunk_size: int = setting(0, "logprobs-chunk-size", "fused chunked support-replay "
                                       "logprobs, rows per chunk (0 = from full logits)", Range(low=0))
    use_packing: bool = setting(False, "use-packing", "pack each microbatch into one row "
                                "(block-diagonal attention)")
    replay_min_overlap_ratio: float = setting(0.0, "replay-min-overlap-ratio", "routing replay "
                                              "check: fail a step when a token's engine routing "
                                              "overlaps the trainer's own router's choice (not the "
                                              "replayed one; the trainer is one step newer) less "
                                              "than this (default 0: never)", Range(0, 1))
    replay_max_mismatch_fraction: float = setting(1.0, "replay-max-mismatch-fraction", "routing "
                                                  "replay check: fail a step when a larger fraction "
                                                  "of tokens than this would route differently "
                                                  "under the trainer's own router (default 1: never)",
                                                  Range(0, 1))
    indexer_replay_min_overlap_ratio: float = setting(
        0.0, "indexer-replay-min-overlap-ratio", "indexer replay check: fail a step when a "
        "token's engine key slots overlap the trainer's own indexer top-k less than this "
        "(default 0: never; at equal precision engine and trainer already break tied scores "
        "differently)", Range(0, 1))
    indexer_replay_max_mismatch_fraction: float = setting(
        1.0, "indexer-replay-max-mismatch-fraction", "indexer replay check: fail a step when a "
        "larger fraction of tokens than this would attend other keys under the trainer's own "
        "indexer (default 1: never)", Range(0, 1))
    dsa_indexer_loss_coeff: float = setting(0.0, "dsa-indexer-loss-coeff", "train the DSA indexer "
                                            "of a deepseek_v32 / glm_moe_dsa policy on the megatron "
                                            "trainer with megatron-core's KL loss against the main "
                                            "attention, scaled by this (0 = off: the indexer stays "
                                            "frozen, as transformers keeps it)", Range(low=0))
    indexer_drift_interval: int = setting(10, "indexer-drift-interval", "compute the trainer's "
                                          "own indexer top-k (the indexer_drift_rate metric) every "
                                          "N updates, the first included (1 = every update); the "
                                          "others skip it and log indexer_drift_rate null",
                                          Range(low=1))
    preflight: str = setting("auto", "preflight", "separate proximal forward before the update: "
                             "auto (only when RS / refill / the replay check need it) or always",
                             Choices(("auto", "always")))
    rpc_timeout_s: float = setting(300.0, "rpc-timeout-seconds", "trainer's actor-call timeout",
                                   POSITIVE)
    torch_threads: int = setting(1, "trainer-torch-threads", "torch threads of the trainer",
                                 Range(low=1))
    backward_threads: int = setting(0, "trainer-backward-threads", "torch threads of the trainer's "
                                    "backward passes, which run mostly while the engines wait "
                                    "for the next weights (0: --trainer-torch-threads)",
                                    Range(low=0))
    trace_decode_threads: int = setting(1, "trace-decode-threads", "threads decoding the indexer "
                                        "top-k trace columns of each batch the trainer takes "
                                        "(the result does not depend on it)", Range(low=1))
    seed: int = setting(1, "seed", check=Range(0, 2 ** 32, "[)"))
    device: str = setting("auto", "device", check=Choices(DEVICES))
    rs_mode: str = setting("none", "rs-mode", "RS gate on exp(logp_prox - logp_rollout): none, "
                           "token, sequence or geometric")
    rs_lower: float = setting(0.0, "rs-lower", "RS lower ratio bound")
    rs_upper: float = setting(float("inf"), "rs-upper", "RS upper ratio bound")
    rs_denominator: str = setting("loss_tokens", "rs-denominator", "loss denominator when RS masks "
                                  "tokens without refill: loss_tokens (every loss token of the "
                                  "step) or accepted_tokens (only the accepted ones)",
                                  Choices(("loss_tokens", "accepted_tokens")))
    stop_on_empty_step: bool = setting(False, "stop-on-empty-step", "end the run at a step with "
                                       "nothing to train (no accepted token); off: skip the step, "
                                       "weights and version unchanged")
    rs_batch_refill: bool = setting(False, "rs-batch-refill", "exact refill: every step trains on "
                                    "exactly --rollout-batch-size whole admitted groups, or fails "
                                    "before the optimizer step")
    rs_refill_max_rounds: int = setting(3, "rs-refill-max-rounds", "replacement rounds per step",
                                        Range(low=0))
    rs_refill_max_candidate_cache_bytes: int = setting(
        1 << 30, "rs-refill-max-candidate-cache-bytes", "bytes the trainer may keep of the "
        "proximal logprobs of exact refill's candidate samples", Range(low=0, closed="()"))
    rs_refill_rpc_timeout_s: float = setting(300.0, "rs-refill-rpc-timeout-seconds",
                                             "timeout of every refill-path actor call", POSITIVE)
    dynamic_sampling: bool = setting(False, "dynamic-sampling", "DAPO dynamic sampling: drop "
                                     "prompt groups whose rewards are all equal and refill them "
                                     "by exact refill (--rs-refill-max-rounds), so every step "
                                     "trains on exactly --rollout-batch-size informative groups")
    dp_size: int = setting(1, "dp-size", "data-parallel trainer ranks (torch.distributed); each "
                           "trains an equal share of every batch, and exact refill replaces "
                           "groups in multiples that split evenly over them",
                           Range(low=1))
    tp_size: int = setting(1, "tp-size", "tensor-parallel size of the megatron trainer "
                           "(sequence parallel with it); trainer ranks = --dp-size x --tp-size "
                           "x --pp-size x --cp-size", Range(low=1))
    ep_size: int = setting(1, "ep-size", "expert-parallel size of the megatron trainer (divides "
                           "--dp-size x --cp-size)", Range(low=1))
    pp_size: int = setting(1, "pp-size", "pipeline-parallel stages of the megatron trainer "
                           "(divides the model's layers; megatron's 1F1B schedule)", Range(low=1))
    cp_size: int = setting(1, "cp-size", "context-parallel size of the megatron trainer (each "
                           "rank holds 2 of 2 x N chunks of every row); trainer ranks = "
                           "--dp-size x --tp-size x --pp-size x --cp-size", Range(low=1))
    vpp_size: int = setting(1, "vpp-size", "virtual pipeline (VPP) stages of the megatron "
                            "trainer; 1, as its pipeline runs without the interleaved schedule",
                            Choices((1,), why="the megatron backend's pipeline runs without the "
                                    "interleaved (VPP) schedule"))
    microbatch_group_size: int = setting(1, "microbatch-group-size", "microbatches per virtual "
                                         "pipeline (VPP) group; exact refill sizes its batches "
                                         "by it when --vpp-size is above 1",
                                         Range(low=1))
    train_backend: str = setting("torch", "train-backend", "the backend that owns and trains "
                                 "the model, a name in the registry "
                                 "replayrl.trainer.backends.BACKENDS",
                                 Choices(tuple(BACKENDS)))
    lora_rank: int = setting(0, "lora-rank", "LoRA rank through peft (0 = off: every weight "
                             "trains); only the adapters train, sit in the optimizer and are "
                             "pushed (torch / fsdp backend, embedded engine)", Range(low=0))
    lora_alpha: float = setting(16.0, "lora-alpha", "LoRA alpha: the adapters are scaled by "
                                "alpha / --lora-rank", POSITIVE)
    lora_target_modules: str = setting("all", "lora-target-modules", "modules LoRA adapts, a comma "
                                       "list (all: every attention and MLP projection the policy "
                                       "has, per family in docs/design/lora.md; gate_proj / up_proj / "
                                       "down_proj: the MLP and every expert, on a family model the "
                                       "fused expert tensors; gate: the MoE router, only when named, "
                                       "not on a family model; q_a_proj / q_b_proj / "
                                       "kv_a_proj_with_mqa / kv_b_proj: MLA attention; in_proj_qkv / "
                                       "in_proj_z / in_proj_b / in_proj_a / out_proj: Qwen3.5's "
                                       "DeltaNet; kv_proj / o_b_proj: DeepSeek-V4's "
                                       "attention; lm_head: an LM head not tied to the embedding)")

    def __post_init__(self) -> None:
        check_settings(self, TrainerConfigError)
        if self.lr == 0.0:  # the run's default, resolved once: every reader sees a number
            object.__setattr__(self, "lr", LORA_LR if self.lora_rank else FULL_WEIGHTS_LR)
        if self.lora_rank:
            from replayrl.trainer.lora.settings import target_modules

            target_modules(self.lora_target_modules)  # raises naming the unknown name
        checks = [
            (not self.lora_rank or self.train_backend in ("torch", "fsdp"),
             f"--lora-rank needs --train-backend torch or fsdp (--train-backend {self.train_backend} "
             f"has no LoRA: megatron-core's modules are not peft's)"),
            (self.rs_mode != "none" or (self.rs_lower, self.rs_upper) == (0.0, float("inf")),
             "--rs-lower / --rs-upper need --rs-mode token|sequence|geometric"),
            (not self.entropy_target or self.entropy_coef > 0,
             "--entropy-target needs --entropy-coef > 0 (the adaptive coefficient's ceiling; "
             "at 0 it would never apply a bonus)"),
            (self.logprobs_chunk_size == 0 or self.use_support_replay,
             "--logprobs-chunk-size needs --use-support-replay (the fused path projects the support)"),
            (not self.rs_batch_refill or self.rs_mode != "none",
             "--rs-batch-refill needs --rs-mode token|sequence|geometric (nothing would be rejected)"),
            (not self.dynamic_sampling or self.rs_mode == "none" or self.rs_batch_refill,
             "--dynamic-sampling with --rs-mode token|sequence|geometric needs --rs-batch-refill "
             "(a group is dropped whole for the gate or for equal rewards, and both refill "
             "through one path; masking rejected tokens instead would leave groups without a "
             "baseline)"),
            (self.train_backend == "megatron" or (self.tp_size, self.ep_size, self.pp_size) == (1, 1, 1),
             f"--tp-size / --ep-size / --pp-size need --train-backend megatron (--train-backend "
             f"{self.train_backend} splits only the data over --dp-size ranks)"),
            (self.train_backend == "megatron" or self.cp_size == 1,
             f"--cp-size needs --train-backend megatron (--train-backend {self.train_backend} "
             f"holds whole rows on every rank)"),
            (self.cp_size == 1 or not self.use_packing,
             f"--cp-size {self.cp_size} shards right-padded rows; --use-packing is not supported "
             f"with it"),
            (self.cp_size == 1 or self.pp_size == 1,
             f"--cp-size {self.cp_size} with --pp-size {self.pp_size}: context parallelism runs "
             f"without pipeline stages (the CP attention is not in the pipeline schedule yet)"),
            # megatron lays the expert layers out as (expert TP = --tp-size) x EP x expert DP
            # within a pipeline stage, so EP groups come from the DP x CP ranks of one TP slice
            ((self.dp_size * self.cp_size) % self.ep_size == 0,
             f"--ep-size {self.ep_size} must divide --dp-size x --cp-size = "
             f"{self.dp_size * self.cp_size} (megatron's expert layers use --tp-size x "
             f"--ep-size ranks of each pipeline stage, the expert tensor-parallel size being "
             f"--tp-size)"),
            (self.train_backend == "megatron" or self.dsa_indexer_loss_coeff == 0.0,
             f"--dsa-indexer-loss-coeff needs --train-backend megatron (megatron-core's DSA "
             f"indexer loss; --train-backend {self.train_backend} keeps the indexer frozen)"),
            (self.train_backend != "megatron" or not self.use_packing,
             "--use-packing is not supported by --train-backend megatron (packed rows need "
             "per-segment RoPE positions)"),
        ]
        for ok, message in checks:
            if not ok:
                raise TrainerConfigError(message)
        # the gate's own check, without building it (rs_policy imports torch)
        check_rs_settings(self.rs_mode, self.rs_lower, self.rs_upper)

    @property
    def backward_switch_threads(self) -> int:
        """The torch threads the backward passes switch to, or 0 when they keep
        ``torch_threads`` (``--trainer-backward-threads`` 0 or equal to
        ``--trainer-torch-threads``)."""
        return self.backward_threads if self.backward_threads not in (0, self.torch_threads) else 0

    @property
    def rank_count(self) -> int:
        """Trainer processes these settings need: ``--dp-size x --tp-size x --pp-size x
        --cp-size`` (docs/design/trainer-ranks.md#trainer-ranks, docs/design/megatron.md#pipeline-parallel,
        docs/design/megatron.md#context-parallel)."""
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size

    def replay_bounds(self, kind: str) -> tuple[float, float]:
        """``(min_overlap_ratio, max_mismatch_fraction)`` of the preflight replay check of
        ``kind``: ``"routing"`` (``--replay-min-overlap-ratio`` /
        ``--replay-max-mismatch-fraction``) or ``"indexer"`` (``--indexer-replay-min-overlap-ratio``
        / ``--indexer-replay-max-mismatch-fraction``); ``(0, 1)`` never fails.

        Raises:
            TrainerConfigError: another kind (names the known ones).
        """
        if kind == "routing":
            return self.replay_min_overlap_ratio, self.replay_max_mismatch_fraction
        if kind == "indexer":
            return self.indexer_replay_min_overlap_ratio, self.indexer_replay_max_mismatch_fraction
        raise TrainerConfigError(f"no replay check of kind {kind!r}; the checks are 'routing' "
                                 f"and 'indexer'")

    @property
    def replay_check_on(self) -> bool:
        """Whether a replay check's bounds can fail a step (either kind's differ from ``(0, 1)``)."""
        return any(self.replay_bounds(kind) != (0.0, 1.0) for kind in ("routing", "indexer"))

    @property
    def rs_gate(self) -> RSGate:
        """The RS gate these settings describe (:mod:`replayrl.trainer.rejection.rs_policy`,
        imported here so these settings load without torch)."""
        from replayrl.trainer.rejection.rs_policy import RSGate

        return RSGate(self.rs_mode, self.rs_lower, self.rs_upper)

    def to_dict(self) -> dict:
        """All fields as a plain dict (for actor kwargs and the run record)."""
        return asdict(self)
