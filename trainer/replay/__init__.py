"""Replay checks: the trainer's own routing (R3) and indexer choices held against the engine's
traces (flip and drift rates, the mismatch error), and the decoding of compact indexer key
sets."""
