"""Parallel pieces of the trainer, for a model split across ranks.

The embedded torch backend (:mod:`replayrl.trainer.backends.torch_backend`) trains on one rank, so
none of these is on its path; the megatron-core backend
(:mod:`replayrl.trainer.backends.megatron_backend`) calls the vocabulary-parallel logprobs and the
replay registry (docs/design/megatron.md#megatron-backend). Context parallelism is not
offered by that backend yet, so only the tests call the context-parallel piece:

* :mod:`replayrl.trainer.parallel.vocab_parallel` -- :func:`vocab_parallel_support_logprobs`,
  support-replay logprobs with the vocabulary split across tensor-parallel ranks (one MAX and
  one SUM all-reduce); equals :func:`replayrl.trainer.loss.logprobs.support_logprobs` on the full logits.
* :mod:`replayrl.trainer.parallel.replay_registry` -- :class:`ReplayRegistry` (routing / indexer trace
  columns by GLOBAL layer id, so every pipeline stage reads its own layers' streams),
  :func:`sp_slice` (a sequence-parallel rank's trace rows, the ``torch.chunk`` split) and
  :func:`fill_own_choice` (a router that cannot take ``-1`` rows gets its own choice there).
* :mod:`replayrl.trainer.parallel.context_parallel` -- :func:`cp_shard_indices`, :func:`cp_shard`,
  :func:`cp_unshard`: the load-balanced context-parallel shards of a
  :class:`replayrl.trainer.batching.packing.PackedLayout` built with ``cp_size``.

Import the submodules directly; this package imports nothing (torch.distributed stays
unloaded until a backend needs it).
"""
