"""The SGLang rollout engine: a client of running SGLang servers' native HTTP API.

Registry name ``"sglang"`` (``--rollout-engine sglang --sglang-urls URL[,URL]``). SGLang runs
as its own server processes (GPU hosts; see the runbook in docs/design/engines.md#sglang-engine);
this engine imports nothing of ``sglang``. It needs ``aiohttp`` (extra ``sglang``), imported
only when the engine is built.

* generation: one batched ``/generate`` per call (``replayrl.rollout.engines.sglang_protocol``), sent to
  this engine's current server; the reply becomes :class:`Generation` objects through the
  protocol's checks (a missing requested field, an off-by-one route offset, bad base64, a
  foreign ``weight_version``: a typed error naming the request, never a zero-filled trace);
* weights: each push is written as a safetensors checkpoint (``config.json`` +
  ``model.safetensors``) to a directory the servers can read, then every server gets
  ``/pause_generation`` -> ``/update_weights_from_disk`` (with ``weight_version`` = the policy
  version as a string, ``flush_cache``) -> ``/continue_generation``. Under ``--weight-sync
  disk`` the trainer's own file is passed on (:meth:`SglangEngine.load_weights_from_disk`);
  under ``--weight-sync dist`` the server joins the trainer's weight group
  (``/init_weights_update_group``) and receives each push's buckets itself
  (``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``, one request per
  bucket, between the same pause and continue; :mod:`replayrl.rollout.weight_sync.dist`);
* faults: one ``aiohttp.ClientSession`` per engine (on the engine's own event-loop thread),
  a timeout on every request, and bounded retries: a server that does not answer (refused,
  reset, timed out, HTTP 5xx) is skipped for the next URL, which is health-checked and given the
  last weights again before the same request (same seeds, so the same generations) is resent.
  The manager has no regenerate path, so the engine call is the unit that is retried; a call
  returns only complete, checked generations, so nothing is lost or half-kept.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from replayrl.rollout.engines.base import Engine, Generation
from replayrl.rollout.engines.sglang_protocol import decode_item, generate_request, parse_urls
from replayrl.rollout.errors import (
    EngineInputError,
    SglangNoAnswer,
    SglangRequestError,
    SglangResponseError,
    SglangUnavailable,
)
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.sample import TRACE_FIELDS
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.transport import strict_json

__all__ = ["SglangEngine"]


# SGLang's own /health_generate waits up to 20 s (HEALTH_CHECK_TIMEOUT) for a busy scheduler
_HEALTH_TIMEOUT_S = 30.0


class SglangEngine(Engine):
    """Generation on SGLang servers over HTTP, capturing every replay trace they return.

    Args:
        model_config: the policy's shape (``ModelConfig`` or its fields, HF names).
        urls: server base URLs (``"http://host:port"``, a list or a comma-separated string);
            this engine starts on the first, the others are its failover order.
        dtype: the dtype the weight files are written in (``"float32"`` / ``"bfloat16"``).
        device: accepted for the common engine arguments (the servers own the devices).
        weight_dir: directory for the pushed weight files, readable by every server at the
            same path; ``""`` = a fresh temporary directory (servers on this host).
        call_timeout_s: seconds one ``/generate`` request may take.
        start_timeout_s: seconds to wait for the first server's ``/health`` at start, and
            the longest one weight update may take (a large checkpoint loads for minutes).
        retries: how many times a request is resent after a server did not answer.

    Raises:
        EngineInputError: malformed ``urls``.
        SglangUnavailable: no server answered ``/health`` within ``start_timeout_s``.
        ImportError: aiohttp is missing (``pip install -e '.[sglang]'``).
    """

    capturable_traces = frozenset(TRACE_FIELDS)

    def __init__(self, model_config: ModelConfig | Mapping[str, Any], *,
                 urls: str | Sequence[str], dtype: str = "float32", device: str = "cpu",
                 weight_dir: str = "", call_timeout_s: float = 300.0,
                 start_timeout_s: float = 600.0, retries: int = 2) -> None:
        super().__init__()
        import aiohttp  # the optional extra, imported only when this engine is chosen

        self._aiohttp = aiohttp
        self.config = (model_config if isinstance(model_config, ModelConfig)
                       else ModelConfig(**model_config))
        self.urls = list(parse_urls(urls))
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if name not in ("float32", "bfloat16", "float16"):
            raise EngineInputError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.dtype = name
        self.call_timeout_s, self.retries = float(call_timeout_s), int(retries)
        self.update_timeout_s = float(start_timeout_s)
        self._own_dir = not weight_dir
        self.weight_dir = Path(weight_dir or tempfile.mkdtemp(prefix="replayrl-sglang-"))
        self._pushed: Path | None = None  # the checkpoint of the loaded version
        self._pushed_owned = False  # whether that checkpoint is this engine's to remove
        self._group_url: str | None = None  # the server in the trainer's weight group (dist)
        self._silent: set[str] = set()  # servers that did not answer the last weight push
        self._calls = 0
        # request ids are unique per server (SGLang keys its request state by rid), also when
        # several engines or runs share one
        self._token = uuid.uuid4().hex[:8]
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="sglang-client",
                         daemon=True).start()
        try:
            self._session = self._run(self._open(), None)
            self._run(self._wait_healthy(self.urls[0], float(start_timeout_s)), None)
        except BaseException:
            self.close()  # a failed start leaves no session and no weight directory behind
            raise

    # -- the event-loop thread ------------------------------------------------------------

    def _run(self, coro, timeout: float | None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _open(self):
        return self._aiohttp.ClientSession(
            timeout=self._aiohttp.ClientTimeout(total=self.call_timeout_s),
            json_serialize=strict_json.dumps)  # request bodies are strict JSON too

    async def _request(self, method: str, url: str, path: str, body: Any = None,
                       what: str = "", timeout_s: float | None = None) -> Any:
        """One HTTP request (``timeout_s``, default the session's ``call_timeout_s``); JSON
        reply (or text). Raises SglangNoAnswer when the server did not answer, SglangRequestError on
        a 4xx (names ``what``)."""
        aiohttp = self._aiohttp
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        try:
            async with self._session.request(method, url + path, json=body,
                                             timeout=timeout) as resp:
                text = await resp.text()
                if resp.status >= 500:
                    raise SglangNoAnswer(f"{url}{path}: HTTP {resp.status}: {text[:200]}")
                if resp.status >= 400:
                    raise SglangRequestError(f"{url}{path} refused {what}: HTTP {resp.status}: "
                                             f"{text[:500]}")
                try:
                    return json.loads(text) if text else None
                except json.JSONDecodeError:
                    return text
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise SglangNoAnswer(f"{url}{path}: {type(exc).__name__}: {exc}") from None

    async def _wait_healthy(self, url: str, timeout_s: float) -> None:
        deadline = self._loop.time() + timeout_s
        why = "no answer"
        while True:
            try:
                await self._request("GET", url, "/health", what="health check",
                                    timeout_s=min(_HEALTH_TIMEOUT_S, timeout_s))
                return
            except (SglangNoAnswer, SglangRequestError) as exc:
                why = str(exc)
            if self._loop.time() >= deadline:
                raise SglangUnavailable(f"SGLang server {url} not healthy within {timeout_s} s: "
                                        f"{why}")
            await asyncio.sleep(min(1.0, max(0.05, deadline - self._loop.time())))

    async def _push(self, url: str, path: Path, version: int) -> None:
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True,
                "abort_all_requests": False}
        await self._paused(url, lambda: self._post_ok(
            url, "/update_weights_from_disk", body, what=f"weights of version {version} from {path}",
            failed=f"version {version} not loaded"))

    async def _post_ok(self, url: str, endpoint: str, body: Mapping[str, Any], *, what: str,
                       failed: str) -> None:
        """POST ``body`` to ``url + endpoint`` within the update timeout and require SGLang's
        ``{"success": true}`` answer (its weight endpoints answer a failure with 200 and
        ``success`` false).

        Raises:
            SglangRequestError: ``"<url><endpoint>: <failed>: <reply>"`` when success is not true.
            SglangNoAnswer: no answer within the update timeout.
        """
        reply = await self._request("POST", url, endpoint, body, what=what,
                                    timeout_s=self.update_timeout_s)
        if not isinstance(reply, Mapping) or not reply.get("success"):
            raise SglangRequestError(f"{url}{endpoint}: {failed}: {reply!r}")

    async def _paused(self, url: str, update) -> None:
        """Await ``update()`` (a coroutine function, called only once the pause succeeded) with
        the server's generation paused (``/pause_generation`` in abort mode before,
        ``/continue_generation`` after, also when it raised): SGLang's weight updates wait for no
        running request."""
        await self._request("POST", url, "/pause_generation", {"mode": "abort"},
                            what="pause before a weight update")
        try:
            await update()
        finally:
            await self._request("POST", url, "/continue_generation", {},
                                what="continue after a weight update")

    async def _with_failover(self, what: str, attempt_fn) -> Any:
        """Run ``attempt_fn(url, resync)`` on the current URL, then the next ones, at most
        ``1 + retries`` times; ``resync`` is True after a failure (push weights again)."""
        errors: list[str] = []
        for attempt in range(self.retries + 1):
            url = self.urls[0]
            try:
                if attempt:
                    await self._wait_healthy(url, self.call_timeout_s)
                return await attempt_fn(url, attempt > 0)
            except (SglangNoAnswer, SglangUnavailable) as exc:
                errors.append(str(exc))
                self.urls.append(self.urls.pop(0))  # sticky failover: next URL first from now on
                await asyncio.sleep(min(0.2 * 2 ** attempt, 2.0))
        raise SglangUnavailable(f"{what}: no SGLang server answered in {self.retries + 1} "
                                f"attempts: " + "; ".join(errors))

    # -- weights ----------------------------------------------------------------------------

    def _write_checkpoint(self, arrays: Mapping[str, Any], version: int) -> Path:
        from safetensors.torch import save_file

        dtype = getattr(torch, self.dtype)
        tensors = {}
        for name, value in arrays.items():
            if isinstance(value, np.ndarray):  # pushes arrive read-only; torch wants writable
                value = torch.from_numpy(value if value.flags.writeable else value.copy())
            t = value
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise EngineInputError(f"load_weights: {name!r} must be a floating array")
            tensors[name] = t.detach().to("cpu", dtype).contiguous()
        path = self.weight_dir / f"version-{version}"
        partial = self.weight_dir / f"version-{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(tensors, str(partial / "model.safetensors"))
        (partial / "config.json").write_text(strict_json.dumps(self.config.to_hf_dict(self.dtype)))
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)  # a server never reads a half-written version
        return path

    def _load_weights(self, arrays: Mapping[str, Any]) -> None:
        """Write the push as a checkpoint and load it on every server (``_version`` is set by
        the caller after this returns, so the version is the one being loaded).

        Raises:
            EngineInputError: a non-floating value.
            SglangRequestError: a server refused the update (bad keys / shapes there).
            SglangUnavailable: a server did not answer within the retries.
        """
        version = self._pending_version
        self._update_servers(self._write_checkpoint(arrays, version), version, owned=True)

    def load_weights_from_disk(self, path: str, *, version: int) -> None:
        """Load a push the disk weight sync wrote (a directory of ``*.safetensors`` at a path
        every server reads) on every server, as policy ``version``; the files stay the
        trainer's.

        Raises:
            as :meth:`_load_weights`, and EngineInputError for a version below the loaded one.
        """
        self._load_version(version, lambda: self._update_servers(Path(path), version, owned=False))

    def _update_servers(self, path: Path, version: int, owned: bool) -> None:
        """Every server loads ``path`` (``/update_weights_from_disk``); a server that does not
        answer is retried, then put last. ``owned``: the directory is this engine's own, removed
        once a later version replaced it."""

        async def push_all() -> None:
            answered, silent = [], []
            for url in self.urls:
                # a server silent at the last push gets one try, without backoff: a dead
                # server must not slow every later push down (it rejoins once it answers)
                tries_left = 0 if url in self._silent else self.retries
                for tries in range(tries_left + 1):
                    try:
                        await self._push(url, path, version)
                        answered.append(url)
                        break
                    except SglangNoAnswer as exc:
                        if tries == tries_left:
                            silent.append((url, str(exc)))
                        else:
                            await asyncio.sleep(min(0.2 * 2 ** tries, 2.0))
            self._silent = {url for url, _ in silent}
            if not answered:
                raise SglangUnavailable(f"weights of version {version}: no SGLang server "
                                        f"answered: {silent}")
            # a server that missed this push goes last; failover pushes again before using it
            self.urls = answered + [url for url, _ in silent]

        self._run(push_all(), None)
        old, old_owned = self._pushed, self._pushed_owned
        self._pushed, self._pushed_owned = path, owned
        if old is not None and old != path and old_owned:
            shutil.rmtree(old, ignore_errors=True)

    def init_weights_update_group(self, spec: Mapping[str, Any]) -> None:
        """Have this engine's server join the trainer's weight group: SGLang's
        ``/init_weights_update_group`` with ``master_address``, ``master_port``, ``rank_offset``,
        ``world_size``, ``group_name`` and ``backend`` of ``spec``; returns once the group formed
        (every member joined). Later pushes go to this server (its failover servers are the
        other engines', each in the group too).

        Raises:
            SglangRequestError: the server refused or could not join (its message).
            SglangNoAnswer: the server did not answer within the update timeout.
        """
        body = {key: spec[key] for key in ("master_address", "master_port", "rank_offset",
                                           "world_size", "group_name", "backend")}
        url = self.urls[0]
        self._run(self._post_ok(url, "/init_weights_update_group", body,
                                what=f"weight group {body['group_name']}",
                                failed=f"group {body['group_name']} not joined"), None)
        self._group_url = url

    def load_weights_from_distributed(self, manifest: Mapping[str, Any], *, version: int) -> None:
        """Have this engine's server receive a dist push (its buckets, broadcast by the trainer
        meanwhile) as policy ``version``: ``/pause_generation``, one
        ``/update_weights_from_distributed`` per bucket (``names``, ``dtypes``, ``shapes``,
        ``group_name``, ``load_format="flattened_bucket"``, ``weight_version``; the cache
        flushed with the last), ``/continue_generation``.

        Raises:
            SglangRequestError: no group joined, or the server failed a bucket.
            SglangNoAnswer: the server did not answer within the update timeout.
        """
        url = self._group_url
        if url is None:
            raise SglangRequestError("load_weights_from_distributed before "
                                     "init_weights_update_group")

        async def buckets() -> None:
            buckets = list(manifest["buckets"])
            for i, bucket in enumerate(buckets):
                body = {"names": bucket["names"], "dtypes": bucket["dtypes"],
                        "shapes": bucket["shapes"], "group_name": manifest["group"],
                        "flush_cache": i == len(buckets) - 1, "abort_all_requests": False,
                        "weight_version": str(version), "load_format": "flattened_bucket"}
                await self._post_ok(url, "/update_weights_from_distributed", body,
                                    what=f"bucket {i} of version {version}",
                                    failed=f"bucket {i} of version {version} not loaded")

        self._load_version(version, lambda: self._run(self._paused(url, buckets), None))

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Have the server leave weight group ``group_name`` (``/destroy_weights_update_group``;
        best effort: an older server has no such route)."""
        url = self._group_url
        self._group_url = None
        if url is not None:
            try:
                self._run(self._request("POST", url, "/destroy_weights_update_group",
                                        {"group_name": group_name}, what="leave the weight group",
                                        timeout_s=_HEALTH_TIMEOUT_S), None)
            except (SglangNoAnswer, SglangRequestError):
                pass

    def load_weights(self, arrays: Mapping[str, Any], *, version: int) -> None:
        """:meth:`Engine.load_weights`; the weight files are named by ``version``."""
        self._pending_version = version
        super().load_weights(arrays, version=version)

    # -- generation -------------------------------------------------------------------------

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                  max_new_tokens: int, eos_token_id: int, seed: int,
                  traces: frozenset[str]) -> list[Generation]:
        """One turn per prompt as one batched ``/generate`` (contract of
        :meth:`Engine.generate`).

        Raises:
            EngineInputError: empty / out-of-vocabulary prompt, ``max_new_tokens < 1``.
            SglangRequestError: the server refused or aborted the request.
            SglangResponseError: a reply item failed a check, a foreign weight version too (names the
                request id and the field).
            SglangUnavailable: no server answered within the retries.
        """
        cfg = self.config
        rows = []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids or any(not 0 <= t < cfg.vocab_size for t in ids):
                raise EngineInputError(f"prompts[{i}] is empty or holds ids outside "
                                       f"[0, {cfg.vocab_size})")
            rows.append(ids)
        if not rows:
            raise EngineInputError("prompts must hold at least one prompt")
        if max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
        self._calls += 1
        rids = [f"replayrl-{self._token}-v{self.version}-c{self._calls}-{i}"
                for i in range(len(rows))]
        body = generate_request(rids, rows, params, max_new_tokens=max_new_tokens,
                                eos_token_id=eos_token_id, seed=seed, traces=traces)
        what = f"generate call {self._calls} (requests {rids[0]}..{rids[-1]})"

        async def attempt(url: str, resync: bool) -> Any:
            if resync and self._pushed is not None:
                await self._push(url, self._pushed, int(self.version))
            reply = await self._request("POST", url, "/generate", body, what=what)
            if not isinstance(reply, list) or len(reply) != len(rows):
                raise SglangResponseError(f"{url}/generate: {what}: expected a list of {len(rows)} "
                                  f"items, got {type(reply).__name__}")
            aborted = [item for item in reply if isinstance(item, Mapping)
                       and isinstance(item.get("meta_info"), Mapping)
                       and isinstance(item["meta_info"].get("finish_reason"), Mapping)
                       and item["meta_info"]["finish_reason"].get("type") == "abort"]
            if aborted:  # e.g. another client paused the server for a weight update: resend
                meta = aborted[0]["meta_info"]
                raise SglangNoAnswer(f"{url}/generate: request {meta.get('id')} aborted by the server: "
                             f"{meta['finish_reason'].get('message')!r}")
            return reply

        reply = self._run(self._with_failover(what, attempt), None)
        width = params.support_width(cfg.vocab_size)
        return [decode_item(item, rid=rid, prompt=prompt, config=cfg, width=width,
                            max_new_tokens=int(max_new_tokens), eos_token_id=int(eos_token_id),
                            traces=traces, weight_version=str(self.version))
                for item, rid, prompt in zip(reply, rids, rows)]

    def close(self) -> None:
        """Close the HTTP session, stop the client thread and remove a temporary weight
        directory. Idempotent; the engine is unusable afterwards."""
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.is_running():
            session = getattr(self, "_session", None)
            if session is not None:
                try:
                    self._run(session.close(), 2)
                except Exception:  # closing is best effort (the process may be exiting)
                    pass
            loop.call_soon_threadsafe(loop.stop)
        if getattr(self, "_own_dir", False):
            shutil.rmtree(self.weight_dir, ignore_errors=True)
            self._own_dir = False

    def __del__(self) -> None:
        self.close()
