"""The zmq weight sync: the push as an array bundle in ordinary memory, sent as ZeroMQ frames.

The trainer copies the tensors once into one buffer per dtype (:func:`pack_tensors`); each
engine's ``load_weights`` call carries the bundle as out-of-band ZeroMQ frames, to an ipc peer
too (the call never uses the shared-memory pool), so this is the path of engines on other
hosts and the baseline the others are measured against (docs/design/transport.md#weight-sync).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from replayrl.rollout.weight_sync.base import Packed, WeightHome, WeightSync
from replayrl.rollout.weight_sync.bundle import bundle_nbytes, load_bundle, pack_tensors

__all__ = ["ZmqSync"]


class ZmqSync(WeightSync):
    """Array bundle in ordinary memory, ZeroMQ frames to every engine (``--weight-sync zmq``)."""

    name = "zmq"

    def pack(self, tensors: Mapping[str, torch.Tensor], *, version: int,
             home: WeightHome | None = None) -> Packed:
        """See :meth:`WeightSync.pack`: one copy into ``np.empty`` buffers; sent as frames."""
        bundle = pack_tensors(tensors, lambda size, dtype: np.empty(size, dtype))
        return Packed(bundle, bundle_nbytes(bundle), frames=True)

    def load(self, engine: Any, received: Any, version: int) -> None:
        """See :meth:`WeightSync.load`: the bundle's arrays, read-only views into its frames."""
        load_bundle(engine, received, version)
