"""Sampling: the sampling parameters of a request (without torch) and the token sampler with
top-k / top-p / min-p that captures the candidate set (support) it sampled from."""
