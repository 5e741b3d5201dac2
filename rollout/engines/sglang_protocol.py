"""SGLang's native ``/generate`` protocol: the request replayrl sends and the reply it accepts.

One module for both ends, so the client (``rollout/engines/sglang_engine.py``) and the test
server (``replayrl serve``, ``tools/serve.py``) cannot drift apart (docs/design/engines.md#sglang-engine).
Every field name below was checked against the source of the newest wheel,
:data:`SGLANG_VERSION_CHECKED` (``sglang/srt/managers/io_struct.py`` ``GenerateReqInput`` /
``UpdateWeightFromDiskReqInput`` / ``PauseGenerationReqInput``,
``sglang/srt/entrypoints/http_server.py`` routes, ``sglang/srt/managers/tokenizer_manager.py``
``meta_info``, ``sglang/srt/state_capturer/*.py`` trace layouts).

Request (one batched ``/generate`` per engine call, items in prompt order): ``rid``,
``input_ids``, ``sampling_params`` (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``max_new_tokens``, ``stop_token_ids = [eos]``, ``no_stop_trim`` so the EOS stays in
``output_ids``, ``sampling_seed``), ``return_logprob``, ``top_logprobs_num = 0``,
``return_sampling_mask`` with ``sampling_logprobs_mode = "selected"``, ``return_routed_experts``
with ``routed_experts_start_len``, ``return_indexer_topk``.

Reply item: ``{"text", "output_ids", "meta_info"}``; ``meta_info`` holds ``id``,
``finish_reason`` (``{"type": "stop", "matched": id}`` / ``{"type": "length", ...}`` /
``{"type": "abort", "message": ...}``), ``prompt_tokens``, ``completion_tokens``,
``weight_version`` (a string), ``output_token_logprobs`` (``[logprob, token_id, text]``
triples), ``output_token_sampling_mask`` (per output token the ids of its sampling support),
``output_token_sampling_logprobs`` (per output token the behaviour logprob of the sampled token,
``log(w_y / sum of support weights)``: the processed distribution), and ``routed_experts`` /
``indexer_topk`` as base64 of little-endian int32 ``[rows, layers, k]``. ``routed_experts``
covers positions ``[routed_experts_start_len, seqlen - 1)`` over *all* ``num_hidden_layers``
(dense layers' columns are not choices; the client keeps ``config.moe_layers``);
``indexer_topk`` covers ``[0, seqlen - 1)`` over the indexer layers (it ignores the start).

Seeds: request ``i`` of a call with seed ``s`` gets ``sampling_seed = s + i`` (mod 2**63).
SGLang hashes (seed, position) per request, so equal prompts of a prompt group need distinct
seeds; the test server recovers ``s`` from the first item and samples the batch exactly as the
in-process embedded engine would with seed ``s``.
"""
from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from replayrl.rollout.engines.base import Generation
from replayrl.rollout.errors import EngineInputError, SglangRequestError, SglangResponseError
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.traces import trace_table

__all__ = [
    "SGLANG_VERSION_CHECKED",
    "SglangResponseError",
    "parse_urls",
    "request_seeds",
    "generate_request",
    "encode_int32",
    "decode_int32",
    "decode_item",
    "BatchRequest",
    "parse_generate_request",
    "encode_item",
]

SGLANG_VERSION_CHECKED = "0.5.23"
"""The sglang wheel whose source every field name here was checked against."""

_SEED_MOD = 2 ** 63
_REQUEST_KEYS = frozenset({
    "rid", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_sampling_mask", "sampling_logprobs_mode",
    "return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "stream"})
_SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k", "min_p", "max_new_tokens",
                            "stop_token_ids", "no_stop_trim", "skip_special_tokens",
                            "sampling_seed", "ignore_eos"})


def parse_urls(text: str | Sequence[str]) -> tuple[str, ...]:
    """``--sglang-urls`` as a tuple of base URLs without a trailing slash.

    Raises:
        EngineInputError: empty, or an entry that is not an ``http://`` / ``https://`` URL.
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    urls = tuple(u.strip().rstrip("/") for u in items if u.strip())
    if not urls:
        raise EngineInputError("--sglang-urls: at least one server URL is needed")
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise EngineInputError(f"--sglang-urls: {bad[0]!r} is not an http:// or https:// URL")
    return urls


def request_seeds(seed: int, n: int) -> list[int]:
    """``sampling_seed`` of the ``n`` requests of a call with seed ``seed``: ``seed + i``
    mod 2**63 (distinct per request; the first is the call's seed)."""
    return [(int(seed) + i) % _SEED_MOD for i in range(n)]


def generate_request(rids: Sequence[str], prompts: Sequence[Sequence[int]],
                     params: SamplingParams, *, max_new_tokens: int, eos_token_id: int,
                     seed: int, traces: frozenset[str]) -> dict[str, Any]:
    """The JSON body of one batched ``/generate`` call (``len(prompts)`` items).

    Always asks for the sampling mask (its ``selected`` logprob is the behaviour logprob under
    the processed distribution) and the output token logprobs (their ids are checked against
    ``output_ids``); routing / indexer capture only when ``traces`` names them. Routing rows
    start at position 0 (``routed_experts_start_len = 0``): a :class:`Generation` covers the
    turn's whole context, and SGLang keeps routing per KV slot, so prefix-cache hits still
    return the rows of the request that computed them.
    """
    sampling = [{"temperature": float(params.temperature), "top_p": float(params.top_p),
                 "top_k": int(params.top_k), "min_p": float(params.min_p),
                 "max_new_tokens": int(max_new_tokens), "stop_token_ids": [int(eos_token_id)],
                 "no_stop_trim": True, "skip_special_tokens": False, "sampling_seed": s}
                for s in request_seeds(seed, len(prompts))]
    body: dict[str, Any] = {
        "rid": list(rids), "input_ids": [[int(t) for t in p] for p in prompts],
        "sampling_params": sampling, "return_logprob": True, "top_logprobs_num": 0,
        "return_sampling_mask": True, "sampling_logprobs_mode": "selected"}
    if "routed_experts" in traces:
        body.update(return_routed_experts=True, routed_experts_start_len=0)
    if "indexer_topk" in traces:
        body["return_indexer_topk"] = True
    return body


def encode_int32(array: np.ndarray) -> str:
    """Base64 of ``array`` as C-order little-endian int32 (SGLang's trace encoding)."""
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode("ascii")


def decode_int32(text: Any, *, rid: str, field: str) -> np.ndarray:
    """Flat int32 array of a base64 trace field.

    Raises:
        SglangResponseError: not a string, not valid base64, or not a whole number of int32.
    """
    if not isinstance(text, str):
        raise SglangResponseError(f"request {rid}: field {field!r}: expected a base64 string, "
                                  f"got {type(text).__name__}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise SglangResponseError(f"request {rid}: field {field!r}: malformed base64 "
                                  f"({exc})") from None
    if len(raw) % 4:
        raise SglangResponseError(f"request {rid}: field {field!r}: {len(raw)} bytes is not a "
                                  f"whole number of int32")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


def _need(meta: Mapping[str, Any], key: str, rid: str) -> Any:
    if key not in meta or meta[key] is None:
        raise SglangResponseError(f"request {rid}: the reply lacks requested field {key!r} "
                                  f"(server started without the capture flag? see "
                                  f"docs/design/engines.md#sglang-engine)")
    return meta[key]


def _rows(flat: np.ndarray, rows: int, layers: int, k: int, *, rid: str, field: str,
          what: str) -> np.ndarray:
    per_row = layers * k
    if flat.size != rows * per_row:
        got = flat.size / per_row if per_row else float("nan")
        hint = (" (off by one row: the rows must cover positions [start, seqlen - 1))"
                if got in (rows - 1, rows + 1) else "")
        raise SglangResponseError(
            f"request {rid}: field {field!r}: {flat.size} int32 values, expected {rows} rows "
            f"x {layers} layers x {k} = {rows * per_row} for {what}{hint}")
    return flat.reshape(rows, layers, k)


def _read_only(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if not a.flags.owndata:
        a = a.copy()
    a.flags.writeable = False
    return a


def decode_item(item: Any, *, rid: str, prompt: Sequence[int], config: ModelConfig,
                width: int, max_new_tokens: int, eos_token_id: int, traces: frozenset[str],
                weight_version: str) -> Generation:
    """One reply item as a :class:`Generation` (trace rows over the whole context).

    Args:
        item: the decoded JSON of one reply item.
        rid: the request id sent (named in every error; ``meta_info.id`` must equal it).
        prompt: the ``P`` context ids sent.
        config: the policy's shape (layers, experts, indexer, vocabulary).
        width: support width ``W`` (``params.support_width(vocab_size)``).
        max_new_tokens, eos_token_id: as sent.
        traces: the traces requested; each must be in the reply.
        weight_version: the version the engine pushed; the reply's must equal it.

    Raises:
        SglangRequestError: the server aborted the request (``finish_reason`` abort).
        SglangResponseError: any field missing, malformed or inconsistent (named), among them a
            ``meta_info.weight_version`` that differs, or a reply spanning several weight versions.
    """
    meta, finish, kind = _reply_header(item, rid=rid, weight_version=weight_version)
    ids = _output_ids(item, meta, finish, kind, rid=rid, prompt_len=len(prompt),
                      vocab_size=config.vocab_size, max_new_tokens=max_new_tokens,
                      eos_token_id=eos_token_id)
    behaviour, support = _behaviour_and_support(meta, ids, rid=rid, width=width,
                                                vocab_size=config.vocab_size)
    p, r = len(prompt), len(ids)
    routed = (_routed_experts(meta, rid=rid, config=config, prompt_len=p, response_len=r)
              if "routed_experts" in traces and config.moe_layers else None)
    indexer = (_indexer_topk(meta, rid=rid, config=config, prompt_len=p, response_len=r)
               if "indexer_topk" in traces and config.indexed_layers else None)
    return Generation(
        response_ids=_read_only(np.asarray(ids, dtype=np.int32)),
        rollout_logprobs=_read_only(behaviour),
        sample_support=_read_only(support) if "sample_support" in traces else None,
        routed_experts=routed, indexer_topk=indexer,
        finish_reason="stop" if kind == "stop" else "length")


def _reply_header(item: Any, *, rid: str, weight_version: str) -> tuple[Mapping, Any, Any]:
    """``(meta_info, finish_reason, finish type)`` of a reply item, after checking that it
    answers ``rid``, was not aborted and was served by ``weight_version`` alone (raises as
    :func:`decode_item` documents)."""
    if not isinstance(item, Mapping) or not isinstance(item.get("meta_info"), Mapping):
        raise SglangResponseError(f"request {rid}: reply item is not an object with meta_info")
    meta = item["meta_info"]
    if meta.get("id", rid) != rid:
        raise SglangResponseError(f"request {rid}: reply item answers request {meta.get('id')!r}")
    finish = _need(meta, "finish_reason", rid)
    kind = finish.get("type") if isinstance(finish, Mapping) else None
    if kind == "abort":
        raise SglangRequestError(f"request {rid}: aborted by the server: "
                                 f"{finish.get('message')!r}")
    version = _need(meta, "weight_version", rid)
    if str(version) != weight_version:
        raise SglangResponseError(f"request {rid}: field 'weight_version': served by weights "
                                 f"{version!r}, expected {weight_version!r}")
    spans = meta.get("weight_versions")
    if spans is not None and len(spans) != 1:
        raise SglangResponseError(f"request {rid}: field 'weight_versions': the response mixes "
                                 f"weight versions {spans!r}")
    return meta, finish, kind


def _output_ids(item: Mapping, meta: Mapping, finish: Any, kind: Any, *, rid: str,
                prompt_len: int, vocab_size: int, max_new_tokens: int,
                eos_token_id: int) -> list[int]:
    """The reply's ``output_ids`` (``R`` ids in ``[0, vocab_size)``), after checking them
    against the finish reason (``stop`` ends with EOS, ``length`` has ``max_new_tokens``) and
    the token counts of ``meta_info`` (raises :class:`SglangResponseError` naming the field)."""
    ids = item.get("output_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
            for t in ids):
        raise SglangResponseError(f"request {rid}: field 'output_ids': expected 1 to "
                                  f"{max_new_tokens} ids in [0, {vocab_size})")
    r = len(ids)
    if kind == "stop":
        if ids[-1] != eos_token_id or finish.get("matched", eos_token_id) != eos_token_id:
            raise SglangResponseError(f"request {rid}: field 'finish_reason': stop on "
                                      f"{finish.get('matched')!r} but the response must end "
                                      f"with EOS {eos_token_id} (no_stop_trim)")
    elif kind == "length":
        if r != max_new_tokens:
            raise SglangResponseError(f"request {rid}: field 'finish_reason': length after "
                                      f"{r} of {max_new_tokens} tokens")
    else:
        raise SglangResponseError(f"request {rid}: field 'finish_reason': unknown {finish!r}")
    if r > max_new_tokens:
        raise SglangResponseError(f"request {rid}: field 'output_ids': {r} tokens > "
                                  f"max_new_tokens {max_new_tokens}")
    for key, want in (("prompt_tokens", prompt_len), ("completion_tokens", r)):
        if key in meta and meta[key] != want:
            raise SglangResponseError(f"request {rid}: field {key!r}: {meta[key]!r}, sent "
                                      f"{want}")
    return ids


def _behaviour_and_support(meta: Mapping, ids: list[int], *, rid: str, width: int,
                           vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Behaviour logprobs (float32 ``[R]``, nats) and sampler support (int32 ``[R, 1 + W]``:
    the sampled id, then the support ids padded with -1) of the ``R`` output tokens, from
    ``output_token_sampling_logprobs`` / ``output_token_sampling_mask``, after checking that
    ``output_token_logprobs`` names the same ids (raises :class:`SglangResponseError`)."""
    r = len(ids)
    triples = _need(meta, "output_token_logprobs", rid)
    if len(triples) != r or any(not isinstance(t, (list, tuple)) or len(t) < 2
                                or t[1] != ids[k] for k, t in enumerate(triples)):
        raise SglangResponseError(f"request {rid}: field 'output_token_logprobs': its token "
                                  f"ids are not the {r} output_ids")
    logprobs = _need(meta, "output_token_sampling_logprobs", rid)
    masks = _need(meta, "output_token_sampling_mask", rid)
    if len(logprobs) != r or len(masks) != r:
        raise SglangResponseError(f"request {rid}: fields 'output_token_sampling_logprobs' / "
                                  f"'output_token_sampling_mask': {len(logprobs)} / "
                                  f"{len(masks)} rows for {r} output tokens")
    behaviour = np.empty(r, dtype=np.float32)
    support = np.full((r, 1 + width), -1, dtype=np.int32)
    for k in range(r):
        value = logprobs[k]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SglangResponseError(f"request {rid}: field 'output_token_sampling_logprobs': "
                                      f"non-finite or non-numeric value {value!r} at response "
                                      f"index {k}")
        behaviour[k] = value
        row = masks[k]
        if (not isinstance(row, list) or not 1 <= len(row) <= width
                or not all(isinstance(t, int) and 0 <= t < vocab_size for t in row)
                or len(set(row)) != len(row) or ids[k] not in row):
            raise SglangResponseError(
                f"request {rid}: field 'output_token_sampling_mask': response index {k} must "
                f"list 1..{width} distinct ids in [0, {vocab_size}) including the "
                f"sampled {ids[k]}")
        support[k, 0] = ids[k]
        support[k, 1:1 + len(row)] = row
    return behaviour, support


def _routed_experts(meta: Mapping, *, rid: str, config: ModelConfig, prompt_len: int,
                    response_len: int) -> np.ndarray:
    """Read-only int32 ``[P + R - 1, len(moe_layers), k]`` expert ids of the MoE layers from
    ``routed_experts`` (which covers every layer), each in ``[0, num_experts)`` (raises
    :class:`SglangResponseError`)."""
    p, r = prompt_len, response_len
    _, k = trace_table.model_shape(trace_table.spec("routed_experts"), config)
    flat = decode_int32(_need(meta, "routed_experts", rid), rid=rid, field="routed_experts")
    rows = _rows(flat, p + r - 1, config.num_hidden_layers, k,
                 rid=rid, field="routed_experts",
                 what=f"positions [0, {p + r - 1}) of {p} prompt + {r} response tokens")
    routed = rows[:, list(config.moe_layers)]
    if ((routed < 0) | (routed >= config.num_experts)).any():
        raise SglangResponseError(f"request {rid}: field 'routed_experts': expert ids "
                                  f"outside [0, {config.num_experts}) in MoE layers")
    return _read_only(routed)


def _indexer_topk(meta: Mapping, *, rid: str, config: ModelConfig, prompt_len: int,
                  response_len: int) -> np.ndarray:
    """Read-only int32 ``[P + R - 1, len(indexed_layers), index_topk]`` key positions from
    ``indexer_topk``, each -1 or causal (``<=`` its row's position; raises
    :class:`SglangResponseError`)."""
    p, r = prompt_len, response_len
    layers, k = trace_table.model_shape(trace_table.spec("indexer_topk"), config)
    flat = decode_int32(_need(meta, "indexer_topk", rid), rid=rid, field="indexer_topk")
    indexer = _rows(flat, p + r - 1, layers, k, rid=rid, field="indexer_topk",
                    what=f"positions [0, {p + r - 1})")
    causal = np.arange(p + r - 1)[:, None, None]
    if not ((indexer == -1) | ((indexer >= 0) & (indexer <= causal))).all():
        raise SglangResponseError(f"request {rid}: field 'indexer_topk': key positions "
                                  f"must be -1 or in [0, row position]")
    return _read_only(indexer)


# -- the server side (replayrl serve) -------------------------------------------------------


@dataclass(frozen=True)
class BatchRequest:
    """A ``/generate`` body as the test server runs it: one embedded-engine call."""

    rids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams
    max_new_tokens: int
    eos_token_id: int
    seed: int
    traces: frozenset[str]
    route_start: int
    return_logprob: bool


def _as_list(value: Any, n: int, key: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"field {key!r}: {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def parse_generate_request(body: Any) -> BatchRequest:
    """Check a ``/generate`` body and turn it into one batched engine call.

    Serves the subset replayrl sends: token ids in, no streaming, no top logprobs, the
    sampling mask in ``selected`` mode; every item with the same sampling settings and seeds
    ``s, s + 1, ...`` (:func:`request_seeds`), so the batch is one embedded-engine call with
    seed ``s``.

    Raises:
        ValueError: anything outside that subset or malformed (the message names the field).
    """
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    unknown = sorted(set(body) - _REQUEST_KEYS)
    if unknown:
        raise ValueError(f"field {unknown[0]!r} is not served by replayrl serve")
    if body.get("stream"):
        raise ValueError("field 'stream': streaming is not served")
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        ids = [ids]
    if not isinstance(ids, list) or not ids or not all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in p) for p in ids):
        raise ValueError("field 'input_ids': expected a non-empty list of non-empty id lists")
    n = len(ids)
    rid = body.get("rid") or "serve"
    if isinstance(rid, list):
        rids = _as_list(rid, n, "rid")
    else:  # one string: SGLang uses it as the prefix of per-item ids
        rids = [str(rid)] if n == 1 else [f"{rid}-{i}" for i in range(n)]
    sampling = _as_list(body.get("sampling_params") or {}, n, "sampling_params")
    first = sampling[0]
    if not isinstance(first, dict) or set(first) - _SAMPLING_KEYS:
        raise ValueError(f"field 'sampling_params': keys "
                         f"{sorted(set(first) - _SAMPLING_KEYS) if isinstance(first, dict) else first} "
                         f"are not served")
    seed = int(first.get("sampling_seed", 0))
    for i, sp in enumerate(sampling):
        rest = {k: v for k, v in sp.items() if k != "sampling_seed"}
        if rest != {k: v for k, v in first.items() if k != "sampling_seed"}:
            raise ValueError(f"field 'sampling_params': item {i} differs from item 0; serve "
                             f"batches one sampling setting per call")
        if int(sp.get("sampling_seed", 0)) != request_seeds(seed, i + 1)[i]:
            raise ValueError(f"field 'sampling_params': item {i} sampling_seed must be "
                             f"item 0's + {i}")
    stops = first.get("stop_token_ids") or []
    if len(stops) != 1 or not first.get("no_stop_trim") or first.get("ignore_eos"):
        raise ValueError("field 'sampling_params': serve needs exactly one stop_token_ids "
                         "entry (the EOS), no_stop_trim true and ignore_eos false")
    params = SamplingParams(temperature=float(first.get("temperature", 1.0)),
                            top_k=int(first.get("top_k", -1)),
                            top_p=float(first.get("top_p", 1.0)),
                            min_p=float(first.get("min_p", 0.0)))
    if int(body.get("top_logprobs_num") or 0) != 0:
        raise ValueError("field 'top_logprobs_num': top logprobs are not served (use "
                         "return_sampling_mask)")
    if body.get("sampling_logprobs_mode", "selected") not in ("selected", None):
        raise ValueError("field 'sampling_logprobs_mode': only 'selected' is served")
    traces = {"sample_support"} if body.get("return_sampling_mask") else set()
    if body.get("return_routed_experts"):
        traces.add("routed_experts")
    if body.get("return_indexer_topk"):
        traces.add("indexer_topk")
    start = body.get("routed_experts_start_len", 0)
    if not isinstance(start, int) or not 0 <= start <= min(len(p) for p in ids):
        raise ValueError(f"field 'routed_experts_start_len': {start!r} outside [0, prompt "
                         f"tokens]")
    return BatchRequest(rids=tuple(str(r) for r in rids), prompts=tuple(tuple(p) for p in ids),
                        params=params, max_new_tokens=int(first.get("max_new_tokens", 128)),
                        eos_token_id=int(stops[0]), seed=seed, traces=frozenset(traces),
                        route_start=start, return_logprob=bool(body.get("return_logprob")),
                        )


def encode_item(gen: Generation, *, rid: str, prompt_len: int, config: ModelConfig,
                request: BatchRequest, weight_version: str) -> dict[str, Any]:
    """A :class:`Generation` as SGLang's reply item (the layouts in the module docstring).

    ``routed_experts`` spans all ``num_hidden_layers``, as SGLang's capturer does; the columns
    of dense layers hold -1 (SGLang leaves zeros there; the client reads only MoE columns).
    """
    ids = gen.response_ids.tolist()
    finish = ({"type": "stop", "matched": request.eos_token_id} if gen.finish_reason == "stop"
              else {"type": "length", "length": len(ids)})
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_len,
                            "completion_tokens": len(ids), "weight_version": weight_version}
    logprobs = gen.rollout_logprobs.tolist()
    if request.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids)]
    if "sample_support" in request.traces:
        meta["output_token_sampling_mask"] = [[int(c) for c in row[1:] if c >= 0]
                                              for row in gen.sample_support]
        meta["output_token_sampling_logprobs"] = logprobs
    if gen.routed_experts is not None:
        full = np.full((len(gen.routed_experts), config.num_hidden_layers,
                        config.num_experts_per_tok), -1, dtype=np.int32)
        full[:, list(config.moe_layers)] = gen.routed_experts
        meta["routed_experts"] = encode_int32(full[request.route_start:])
    if gen.indexer_topk is not None:
        meta["indexer_topk"] = encode_int32(gen.indexer_topk)
    return {"text": "", "output_ids": ids, "meta_info": meta}
