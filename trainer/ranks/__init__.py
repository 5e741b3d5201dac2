"""The trainer's ranks: the TrainerActor (rank 0: preflight, the RS gate and exact refill, the
update, the weight push), ranks 1 .. N-1, the process group and the split of a batch over
data-parallel ranks, one rank's share of a step, and the proximal logprobs held in pinned CPU
memory between preflight and update."""
