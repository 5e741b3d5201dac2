"""Tokenization and prompt data: the run's tokenizer and chat template read from a checkpoint
(through transformers or the tokenizers library alone), the prompt files a run reads and
checks, and the seeded, checkpointable stream of prompts that feeds the rollout manager."""
