"""Per-layer key/value cache of the embedded model for incremental decoding."""

from __future__ import annotations

import torch

from replayrl.rollout.model.errors import ModelInputError
from replayrl.rollout.model.shared_prefix import SharedPrefix, block_size


def append_along(past: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cat([past, new], dim)`` (same values, same shape and dtype), in place when it can.

    Without autograd, when ``past`` is what this function returned before (the leading slice
    along ``dim`` of a larger contiguous buffer) and the buffer has room for ``new``, ``new`` is
    copied after it and the longer slice of the same buffer is returned: no copy of ``past``.
    Otherwise a new buffer of twice the needed length along ``dim`` is allocated, filled and
    sliced. Slots after the returned slice are scratch: a later call may overwrite them, so a
    cache that was extended must not be extended again from an earlier, shorter slice of the
    same buffer (:class:`KVCache` never does: it keeps only the latest slice).

    The slice carries its buffer as the attribute ``_kv_buffer``: under ``torch.inference_mode``
    (the engine's decode loop) a view's ``_base`` is None, and finding the buffer through it
    made every append a reallocation and a copy of the whole cache (O(S) a token, not O(1)).
    """
    if torch.is_grad_enabled() and (past.requires_grad or new.requires_grad):
        return torch.cat([past, new], dim=dim)
    length, extra = past.shape[dim], new.shape[dim]
    base = getattr(past, "_kv_buffer", None)
    if (base is not None and base.dim() == past.dim()
            and base.shape[dim] >= length + extra and past.data_ptr() == base.data_ptr()
            and all(base.shape[d] == past.shape[d] for d in range(past.dim()) if d != dim)
            and base.dtype == new.dtype):
        base.narrow(dim, length, extra).copy_(new)
        out = base.narrow(dim, 0, length + extra)
    else:
        shape = list(new.shape)
        shape[dim] = 2 * (length + extra)
        base = new.new_empty(shape)  # contiguous
        base.narrow(dim, 0, length).copy_(past)
        base.narrow(dim, length, extra).copy_(new)
        out = base.narrow(dim, 0, length + extra)
    out._kv_buffer = base
    return out


class KVCache:
    """Keys, values and indexer keys of every token already forwarded, per batch row.

    Made by `Qwen3MoeForCausalLM.new_kv_cache()` and passed to `forward(kv_cache=...)`, which
    appends the new tokens in place. Opaque to callers except `length` (S_past: number of key
    slots already cached, padding slots included) and `batch_size`.

    Layout (per layer, model dtype): keys and values `[B, num_key_value_heads, S_past, head_dim]`
    after k_norm and RoPE; indexer keys `[B, S_past, index_head_dim]` on indexed layers; and the
    key padding mask `[B, S_past]` (True = real token), used to check that the next call's
    `key_padding_mask` starts with the same prefix. Under autograd the cache grows by
    concatenation (each step copies O(S_past)); without it (the engine's decode loop) the layers
    write the new keys in place into buffers with room to spare (:func:`append_along`), which
    copy only when they double. After :meth:`share_rows`, a dense (not indexed) layer holds its
    prompt keys once per block of rows (:class:`SharedPrefix`) and its per-row keys and values
    from the prompt's end on only.
    """

    def __init__(self, num_layers: int, indexed_layers: tuple[int, ...]) -> None:
        self._num_layers = num_layers
        self._indexed_layers = tuple(indexed_layers)
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._index_keys: dict[int, torch.Tensor | None] = {i: None for i in self._indexed_layers}
        self._padding_mask: torch.Tensor | None = None
        self._length = 0
        self._shared: list[SharedPrefix | None] = [None] * num_layers

    @property
    def length(self) -> int:
        """Number of cached key slots S_past (padding slots included)."""
        return self._length

    @property
    def batch_size(self) -> int | None:
        """Batch size of the cached rows, or None while the cache is empty."""
        return None if self._padding_mask is None else int(self._padding_mask.shape[0])

    # The methods below are the model's side of the contract; callers do not use them.

    def check_compatible(self, num_layers: int, indexed_layers: tuple[int, ...], batch: int,
                         key_padding_mask: torch.Tensor) -> None:
        """Raise `ModelInputError` unless this cache fits the model and the new call.

        `key_padding_mask`: bool `[B, S_past + S]`, already defaulted by the caller.
        """
        if num_layers != self._num_layers or tuple(indexed_layers) != self._indexed_layers:
            raise ModelInputError("kv_cache was made by a model with other layers; use model.new_kv_cache()")
        if self._padding_mask is None:
            return
        if batch != self.batch_size:
            raise ModelInputError(f"kv_cache holds batch size {self.batch_size}, input_ids has {batch}")
        if not torch.equal(key_padding_mask[:, : self._length], self._padding_mask):
            raise ModelInputError(
                "key_padding_mask[:, :kv_cache.length] differs from the padding of the cached tokens")

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                        SharedPrefix | None] | None:
        """Cached (keys, values, indexer keys or None, shared prefix or None) of `layer`, or None
        while empty. With a shared prefix the keys and values are the slots after it."""
        if self._keys[layer] is None:
            return None
        return self._keys[layer], self._values[layer], self._index_keys.get(layer), self._shared[layer]

    def commit(self, keys: list[torch.Tensor], values: list[torch.Tensor],
               index_keys: dict[int, torch.Tensor], key_padding_mask: torch.Tensor) -> None:
        """Replace the cache by the full (past + new) tensors of one finished forward.

        Swapping everything at the end keeps the cache unchanged if the forward raised midway.
        """
        self._keys = list(keys)
        self._values = list(values)
        self._index_keys = {i: index_keys[i] for i in self._indexed_layers}
        self._padding_mask = key_padding_mask
        self._length = int(key_padding_mask.shape[1])

    def select_rows(self, rows: torch.Tensor) -> "KVCache":
        """A new cache whose batch row ``i`` is this cache's row ``rows[i]`` (int64 ``[B']``).

        Differentiable (``index_select``): a prefix forwarded once for several rows (e.g. the
        shared prompt of a GRPO group) gets the gradients of every row that reads it. A shared
        prefix is expanded back to one row per row.
        """
        out = KVCache(self._num_layers, self._indexed_layers)
        pick = lambda t: None if t is None else t.index_select(0, rows)
        whole = [self._whole(i) for i in range(self._num_layers)]
        out._keys = [pick(k) for k, _ in whole]
        out._values = [pick(v) for _, v in whole]
        out._index_keys = {i: pick(t) for i, t in self._index_keys.items()}
        out._padding_mask = pick(self._padding_mask)
        out._length = self._length
        return out

    def share_rows(self, rows: torch.Tensor) -> "KVCache":
        """:meth:`select_rows` for a decode loop over prompt groups: a new cache whose batch row
        ``i`` reads this cache's row ``rows[i]`` (int64 ``[B]``).

        Where ``rows`` is runs of ``R > 1`` equal values (the samples of each prompt group side by
        side, :func:`replayrl.rollout.model.shared_prefix.block_size`), the cache is on the CPU,
        holds no shared prefix yet and autograd is off, each dense layer keeps its keys and values
        once per block as a :class:`SharedPrefix` and starts its per-row keys empty (the decode
        steps append after it); indexed layers, whose decode reads only the kept keys, and the
        padding mask get one row per row. Otherwise the same as :meth:`select_rows`.
        """
        r = 0
        if (not torch.is_grad_enabled() and self._padding_mask is not None
                and self._padding_mask.device.type == "cpu" and all(s is None for s in self._shared)):
            r = block_size(rows)
        if not r:
            return self.select_rows(rows)
        out = KVCache(self._num_layers, self._indexed_layers)
        heads = rows[::r]
        # in the keys' dtype: the attention kernel takes its mask in the query's, once per share
        bias = torch.zeros(self._padding_mask.shape, dtype=self._keys[0].dtype).masked_fill_(
            ~self._padding_mask, float("-inf"))[heads][:, None, None, :]
        for i, (keys, values) in enumerate(zip(self._keys, self._values)):
            if i in self._indexed_layers:
                out._keys[i], out._values[i] = keys.index_select(0, rows), values.index_select(0, rows)
                continue
            keys, values = keys.index_select(0, heads), values.index_select(0, heads)
            out._shared[i] = SharedPrefix(keys, values, bias, r)
            out._keys[i] = keys.new_empty((len(rows), keys.shape[1], 0, keys.shape[3]))
            out._values[i] = values.new_empty((len(rows), values.shape[1], 0, values.shape[3]))
        out._index_keys = {i: None if t is None else t.index_select(0, rows)
                           for i, t in self._index_keys.items()}
        out._padding_mask = self._padding_mask.index_select(0, rows)
        out._length = self._length
        return out

    def _whole(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The keys and values of every slot of ``layer``, one row per batch row (a shared
        prefix expanded and put before the row's own slots)."""
        shared, keys, values = self._shared[layer], self._keys[layer], self._values[layer]
        if shared is None:
            return keys, values
        prefix_keys, prefix_values = shared.expanded()
        return torch.cat([prefix_keys, keys], 2), torch.cat([prefix_values, values], 2)
