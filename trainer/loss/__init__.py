"""The loss: GRPO advantages within a prompt group, the decoupled PPO clip with truncated
importance sampling, and the logprob paths the loss reads (full vocabulary, support replay,
the fused chunked LM head)."""
