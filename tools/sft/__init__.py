"""``replayrl sft``: supervised fine-tuning on chat conversations, loss on the assistant's tokens
(docs/sft.md)."""
