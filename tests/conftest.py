"""Suite-wide settings: one intra-op thread per test process.

The suite runs on 2-core machines shared with other work; two OpenMP threads waiting on each
other made single small forwards 40x slower than one thread (measured in tests/test_replay.py).
Actor processes set their own thread counts.
"""
import torch

torch.set_num_threads(1)
