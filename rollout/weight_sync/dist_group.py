"""The weight group's wire protocol: a torch.distributed group made for the push, and its buckets.

Both ends of the dist weight sync use this module -- trainer rank 0 (rank 0 of the group), the
engine actors, and ``replayrl serve`` (whose ``/init_weights_update_group`` and
``/update_weights_from_distributed`` stand in for an SGLang server's) -- and it follows SGLang's
own, so a real SGLang server joins the same group (checked against
``sglang/srt/utils`` ``init_custom_process_group`` and
``sglang/srt/weight_sync/tensor_bucket.py`` ``FlattenedTensorBucket``, sglang 0.5):

* the group: a ``TCPStore`` at ``master_address:master_port`` (rank 0 hosts it), wrapped in
  ``PrefixStore(group_name, store)``, and a process group over it built as
  ``torch.distributed.init_process_group`` builds one (``_new_process_group_helper``) but outside
  the process's default group, so a trainer rank keeps its own world; ``gloo`` for CPU tensors,
  ``nccl`` for CUDA ones (:func:`group_backend`); gloo's sockets on the interface that reaches
  the master (``GLOO_SOCKET_IFNAME`` when a process sets none);
* a bucket: tensors whose bytes are concatenated, in order, into one uint8 tensor (each tensor
  ``flatten().view(uint8)``), described by ``names``, ``dtypes`` (torch dtype names without
  ``torch.``) and ``shapes`` -- SGLang's ``load_format="flattened_bucket"`` -- and sent as one
  broadcast from rank 0.

The group's store and sockets are not authenticated (as torchrun's are not): the hosts'
network must be trusted (docs/security.md).
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from replayrl.rollout.errors import WeightSyncError

__all__ = ["Bucket", "DEFAULT_BUCKET_BYTES", "address_toward", "broadcast_bucket", "bucket_nbytes",
           "check_spec", "destroy_group", "flatten", "group_backend", "interface_of", "join_group", "make_store",
           "plan_buckets", "receive_bucket", "spec_of"]

DEFAULT_BUCKET_BYTES = 512 * 2 ** 20
"""Largest bucket (bytes) of a push: a bigger tensor gets a bucket of its own. Each bucket is one
broadcast and one buffer of its size on every end while it is in flight."""

Bucket = dict[str, list]
"""``{"names": [str], "dtypes": [str], "shapes": [[int]]}``: one broadcast's tensors, in order."""


def group_backend(device: torch.device | str) -> str:
    """``"nccl"`` for tensors on a CUDA device, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def address_toward(host: str) -> str:
    """The address of this host that ``host`` reaches it at: the source address the kernel
    picks for a route to ``host`` (no packet is sent); ``127.0.0.1`` for a loopback host."""
    if host in ("", "localhost") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds IPv4 ``address`` (Linux), or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


@contextlib.contextmanager
def _gloo_interface(master_address: str) -> Iterator[None]:
    """Gloo's sockets on the interface this host reaches ``master_address`` by, unless the
    process chose one (``GLOO_SOCKET_IFNAME``): gloo's default, the address the host name
    resolves to, is loopback on many hosts, which a member on another host cannot reach."""
    own = address_toward(master_address)
    name = None if "GLOO_SOCKET_IFNAME" in os.environ or own.startswith("127.") else interface_of(own)
    if name is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


def make_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's store, hosted by rank 0 on a free port of every interface (``.port``)."""
    return dist.TCPStore("0.0.0.0", 0, world_size, True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def join_group(*, backend: str, master_address: str, master_port: int, rank: int,
               world_size: int, group_name: str, timeout_s: float,
               store: dist.Store | None = None) -> Any:
    """Join (rank 0: form) the weight group; blocks until every rank joined.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        master_address, master_port: rank 0's store (ignored when ``store`` is given).
        rank, world_size: this process's rank and the group's size.
        group_name: the group's name, unique per process (a new one per group formed).
        timeout_s: how long a rank waits for the others, here and in every broadcast.
        store: rank 0's own store (:func:`make_store`); None: connect to the master's.
    Returns:
        the ``torch.distributed`` process group (use with :func:`broadcast_bucket` /
        :func:`receive_bucket`; :func:`destroy_group` when done).
    Raises:
        WeightSyncError: an unknown backend, or the group did not form within ``timeout_s``
            (names the address and the group).
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"weight group backend must be gloo or nccl, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is None:
            store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}",
                                                      rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        with _gloo_interface(master_address):
            group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                                 PrefixStore(group_name, store),
                                                 group_name=group_name, backend_options=None,
                                                 timeout=timeout)
    except (RuntimeError, ValueError, TimeoutError) as exc:
        raise WeightSyncError(f"weight group {group_name!r} at {master_address}:{master_port} "
                              f"(rank {rank} of {world_size}, {backend}) did not form: "
                              f"{type(exc).__name__}: {exc}") from None
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group: Any) -> None:
    """Leave ``group`` (best effort: a member may be gone already)."""
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001  (leaving is best effort; the group is dropped either way)
        pass


def plan_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Split the names of ``tensors`` (in order) into buckets of at most ``bucket_bytes``; a
    tensor larger than that gets a bucket of its own.

    Raises:
        ValueError: ``bucket_bytes < 1``.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[str]] = []
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bucket's data: every tensor's bytes in order, one new uint8 tensor on their device
    (a copy: the weights may train on while it is sent)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def spec_of(names: Sequence[str], tensors: Mapping[str, torch.Tensor]) -> Bucket:
    """The :data:`Bucket` description of ``names`` of ``tensors``."""
    return {"names": list(names),
            "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [[int(d) for d in tensors[n].shape] for n in names]}


def check_spec(spec: Any) -> list[tuple[str, torch.dtype, list[int]]]:
    """``(name, dtype, shape)`` of every tensor of a bucket description.

    Raises:
        WeightSyncError: not ``{"names", "dtypes", "shapes"}`` of equal lengths, an unknown
            dtype or a bad shape (names the entry).
    """
    ok = (isinstance(spec, Mapping) and all(isinstance(spec.get(k), list)
                                            for k in ("names", "dtypes", "shapes"))
          and len(spec["names"]) == len(spec["dtypes"]) == len(spec["shapes"]))
    if not ok:
        raise WeightSyncError(f"weight bucket must be {{names, dtypes, shapes}} of equal "
                              f"lengths, got {spec!r}"[:300])
    out = []
    for name, dtype, shape in zip(spec["names"], spec["dtypes"], spec["shapes"]):
        t = getattr(torch, str(dtype), None)
        if not isinstance(name, str) or not isinstance(t, torch.dtype) or not t.is_floating_point:
            raise WeightSyncError(f"weight bucket entry {name!r}: dtype {dtype!r} is not a "
                                  f"floating torch dtype")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise WeightSyncError(f"weight bucket entry {name!r}: bad shape {shape!r}")
        out.append((name, t, shape))
    return out


def bucket_nbytes(entries: Sequence[tuple[str, torch.dtype, list[int]]]) -> int:
    """Bytes of a bucket's data (:func:`check_spec` entries)."""
    return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, d, s in entries)


def broadcast_bucket(data: torch.Tensor, group: Any) -> None:
    """Send one bucket's data (uint8, on the group backend's device) from rank 0."""
    dist.broadcast(data, group=group, group_src=0)


def receive_bucket(spec: Any, group: Any, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Receive one bucket broadcast from rank 0 into a new buffer on ``device``; name -> tensor
    (views of that buffer, each of its dtype and shape).

    Raises:
        WeightSyncError: a bad bucket description (:func:`check_spec`), or the broadcast failed.
    """
    entries = check_spec(spec)
    data = torch.empty(bucket_nbytes(entries), dtype=torch.uint8, device=device)
    try:
        dist.broadcast(data, group=group, group_src=0)
    except (RuntimeError, ValueError) as exc:
        raise WeightSyncError(f"weight bucket of {len(entries)} tensors not received: "
                              f"{type(exc).__name__}: {exc}") from None
    out, offset = {}, 0
    for name, dtype, shape in entries:
        size = torch.empty((), dtype=dtype).element_size()
        chunk = data[offset:offset + math.prod(shape) * size]
        if offset % size:  # after tensors of a narrower dtype: a view would be misaligned
            chunk = chunk.clone()
        out[name] = chunk.view(dtype).view(shape)
        offset += chunk.numel()
    return out
