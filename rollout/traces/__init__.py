"""Trace capture and storage: the per-token trace arrays of a trajectory (routing, indexer sets,
sampler support), the trace table that describes every one once, how a column is stored on the
wire, the normalisation of external engines' captures, and the transformations (turn assembly,
truncation) that keep every array aligned with the tokens."""
