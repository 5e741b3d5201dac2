"""LoRA: the --lora-* settings and their check (no torch), and LoRA on the policy through peft
(adapters, their arrays for the engine, the merged state)."""
