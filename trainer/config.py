"""Configuration of the trainer side: optimizer, loss, replays, timeouts."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from trainer.backends import BACKENDS
from trainer.rejection.rs_policy import RSGate


class TrainerConfigError(ValueError):
    """An unsupported trainer setting; the message names the flag."""


@dataclass(frozen=True)
class TrainerConfig:
    """Everything the TrainerActor needs besides the model.

    Attributes:
        lr, weight_decay, adam_beta1, adam_beta2, clip_grad: AdamW (``--lr`` ...).
        eps_clip, eps_clip_high: PPO clip range ``[1 - eps_clip, 1 + eps_clip_high]``.
        tis_cap: TIS weight cap ``C`` (``--tis-cap``); ``None`` disables TIS.
        normalize_advantage_std: GRPO divides by the group std (``--grpo-std-normalization``).
        micro_batch_size: samples per forward/backward (gradient accumulation).
        temperature: the rollout temperature (logprobs are of ``logits / temperature``).
        use_routing_replay, use_indexer_replay, use_support_replay: R3, indexer replay and
            support-replay logprobs (``--use-routing-replay`` ...).
        replay_min_overlap_ratio, replay_max_mismatch_fraction: the preflight replay check
            (``--replay-min-overlap-ratio`` / ``--replay-max-mismatch-fraction``): the engine's
            experts / keys against the trainer's own choice, per token; the defaults (0, 1)
            never fail. A step that violates them raises before training, listing mismatches.
        use_packing: each microbatch is one packed row (``--use-packing``) built from one
            :class:`trainer.packing.PackedLayout`, instead of right-padded rows.
        logprobs_chunk_size: > 0 uses the fused chunked LM-head path for support replay
            (``--logprobs-chunk-size``; peak memory bounded by the chunk, not N x V).
        rpc_timeout_s: seconds any trainer-initiated actor call may take.
        torch_threads: intra-op threads of the trainer process.
        seed: torch seed of the trainer process.
        rs_mode, rs_lower, rs_upper: the RS gate (``--rs-mode none|token|sequence|geometric``).
        rs_denominator: loss denominator when RS rejects tokens without refill
            (``loss_tokens`` | ``accepted_tokens``), see :mod:`trainer.rejection.rs_policy`.
        rs_batch_refill: exact refill (``--rs-batch-refill``): train on exactly
            ``rollout_batch_size`` admitted groups or do not step.
        rs_refill_max_rounds: replacement rounds before the step fails.
        rs_refill_max_candidate_cache_bytes: byte cap of the proximal-logprob cache.
        rs_refill_rpc_timeout_s: timeout of every actor call on the refill path.
        dp_size, vpp_size, microbatch_group_size: the parallel layout the refill quantum is
            computed for; this launcher runs one trainer rank, so only 1 / 1 / any is supported.
        train_backend: the model-owning backend, a name in :data:`trainer.backends.BACKENDS`
            (``--train-backend``).
    """

    lr: float = 3e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    clip_grad: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    tis_cap: float | None = 2.0
    normalize_advantage_std: bool = False
    micro_batch_size: int = 64
    temperature: float = 1.0
    use_routing_replay: bool = True
    use_indexer_replay: bool = True
    use_support_replay: bool = True
    logprobs_chunk_size: int = 0
    use_packing: bool = False
    replay_min_overlap_ratio: float = 0.0
    replay_max_mismatch_fraction: float = 1.0
    rpc_timeout_s: float = 300.0
    torch_threads: int = 1
    seed: int = 1
    rs_mode: str = "none"
    rs_lower: float = 0.0
    rs_upper: float = float("inf")
    rs_denominator: str = "loss_tokens"
    rs_batch_refill: bool = False
    rs_refill_max_rounds: int = 3
    rs_refill_max_candidate_cache_bytes: int = 1 << 30
    rs_refill_rpc_timeout_s: float = 300.0
    dp_size: int = 1
    vpp_size: int = 1
    microbatch_group_size: int = 1
    train_backend: str = "torch"

    def __post_init__(self) -> None:
        checks = [
            (self.lr > 0, "--lr must be > 0"),
            (self.weight_decay >= 0, "--weight-decay must be >= 0"),
            (self.torch_threads >= 1, "--trainer-torch-threads must be >= 1"),
            (0 <= self.seed < 2 ** 32, "--seed must be in [0, 2**32)"),
            (self.rs_mode != "none" or (self.rs_lower, self.rs_upper) == (0.0, float("inf")),
             "--rs-lower / --rs-upper need --rs-mode token|sequence|geometric"),
            (self.clip_grad > 0, "--clip-grad must be > 0"),
            (0 < self.eps_clip < 1, "--eps-clip must be in (0, 1)"),
            (self.eps_clip_high > 0, "--eps-clip-high must be > 0"),
            (self.tis_cap is None or self.tis_cap > 0, "--tis-cap must be > 0"),
            (self.micro_batch_size >= 1, "--micro-batch-size must be >= 1"),
            (self.logprobs_chunk_size >= 0, "--logprobs-chunk-size must be >= 0"),
            (0 <= self.replay_min_overlap_ratio <= 1, "--replay-min-overlap-ratio must be in [0, 1]"),
            (0 <= self.replay_max_mismatch_fraction <= 1,
             "--replay-max-mismatch-fraction must be in [0, 1]"),
            (self.logprobs_chunk_size == 0 or self.use_support_replay,
             "--logprobs-chunk-size needs --use-support-replay (the fused path projects the support)"),
            (self.temperature > 0, "--rollout-temperature must be > 0"),
            (self.rpc_timeout_s > 0, "--rpc-timeout-seconds must be > 0"),
            (self.rs_denominator in ("loss_tokens", "accepted_tokens"),
             "--rs-denominator must be loss_tokens or accepted_tokens"),
            (not self.rs_batch_refill or self.rs_mode != "none",
             "--rs-batch-refill needs --rs-mode token|sequence|geometric (nothing would be rejected)"),
            (self.rs_refill_max_rounds >= 0, "--rs-refill-max-rounds must be >= 0"),
            (self.rs_refill_max_candidate_cache_bytes > 0,
             "--rs-refill-max-candidate-cache-bytes must be > 0"),
            (self.rs_refill_rpc_timeout_s > 0, "--rs-refill-rpc-timeout-seconds must be > 0"),
            (self.dp_size == 1, "--dp-size > 1 is not supported: this launcher runs one trainer rank"),
            (self.vpp_size == 1, "--vpp-size > 1 is not supported: the embedded trainer has no pipeline"),
            (self.microbatch_group_size >= 1, "--microbatch-group-size must be >= 1"),
            (self.train_backend in BACKENDS, f"--train-backend {self.train_backend!r} is not a known "
                                             f"trainer backend; known: {', '.join(sorted(BACKENDS))}"),
        ]
        for ok, message in checks:
            if not ok:
                raise TrainerConfigError(message)
        RSGate(self.rs_mode, self.rs_lower, self.rs_upper)  # raises RSConfigError naming flags

    @property
    def rs_gate(self) -> RSGate:
        """The RS gate these settings describe."""
        return RSGate(self.rs_mode, self.rs_lower, self.rs_upper)

    def to_dict(self) -> dict:
        """All fields as a plain dict (for actor kwargs and the run record)."""
        return asdict(self)
