"""Batching: trajectories collated into right-padded trainer tensors with their traces, packed
microbatches built once and applied to tokens, masks and every trace, and the prefix-tree
layout that forwards a shared prompt once."""
