"""``replayrl serve``: the embedded engine behind SGLang's native HTTP API.

Serves the subset of SGLang's endpoints that ``--rollout-engine sglang`` uses, with SGLang's
field names and encodings (``rollout/engines/sglang_protocol.py``, checked against
:data:`replayrl.rollout.engines.sglang_protocol.SGLANG_VERSION_CHECKED`), so the SGLang client is
exercised end to end against a real server on CPU (docs/design/engines.md#sglang-engine):

* ``POST /generate`` -- one batched embedded-engine call per request body;
* ``POST /update_weights_from_disk`` -- ``model_path`` (a directory with ``*.safetensors``) and
  ``weight_version`` (the policy version as a decimal string);
* ``POST /pause_generation`` / ``POST /continue_generation`` -- requests wait while paused;
* ``GET|POST /flush_cache`` -- nothing to flush (the embedded engine keeps no cache between
  calls), answered as SGLang does;
* ``POST /init_weights_update_group`` -- join a trainer's weight group (``master_address``,
  ``master_port``, ``rank_offset``, ``world_size``, ``group_name``, ``backend``: gloo here), as
  rank ``rank_offset``; answers once the group formed;
* ``POST /update_weights_from_distributed`` -- receive one broadcast of that group (``names``,
  ``dtypes``, ``shapes``, ``group_name``, ``weight_version``; ``load_format`` ``"flattened_bucket"``:
  the tensors' bytes as one buffer, else one broadcast per tensor); the embedded engine loads
  whole weight sets only, so the tensors of one ``weight_version`` are kept until every weight
  of the model arrived, then loaded at once; the group's protocol is
  :mod:`replayrl.rollout.weight_sync.dist_group`;
* ``POST /destroy_weights_update_group`` -- leave a weight group (``group_name``);
* ``GET /health``, ``GET /health_generate``.

It starts without weights (``weight_version`` ``"default"``); ``/generate`` is refused with
HTTP 400 until the first ``/update_weights_from_disk`` (or a distributed update of every
weight), which replaces every weight: so the
server takes only the policy's shape from the run flags (the same for every ``--seed``), and
has no ``--seed`` -- the weights it generates with are always the pushed ones. Generation runs on one worker thread,
one call at a time, so health checks stay answered during a long call. Built on aiohttp's
server (extra ``serve``). It binds to loopback unless told otherwise: ``model_path`` names a
directory on the server's host.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.engines.precision import resolve_dtype
from replayrl.rollout.engines.sglang_protocol import encode_item, parse_generate_request
from replayrl.rollout.errors import EngineError, WeightSyncError
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.errors import CheckpointError
from replayrl.rollout.weight_sync import dist_group
from replayrl.rollout.weight_sync.dist import in_daemon_thread
from replayrl.transport import strict_json

__all__ = ["ServeState", "build_app", "main"]

log = logging.getLogger(__name__)


def _json_response(body: Any, status: int = 200):
    """``aiohttp.web.json_response`` written by the project's strict JSON writer
    (``replayrl.transport.strict_json``: never ``NaN`` / ``Infinity``)."""
    from aiohttp import web

    return web.json_response(body, status=status, dumps=strict_json.dumps)


def _error(status: int, message: str):
    # SGLang's error body (http_server._create_error_response): {"error": {"message", "code"}}
    return _json_response({"error": {"message": message, "code": status}}, status=status)


class ServeState:
    """The served engine, its weight version string and the pause gate.

    Args:
        config: the policy's shape.
        dtype: the engine dtype (a torch dtype name).
    """

    def __init__(self, config: ModelConfig, dtype: str) -> None:
        self.config = config
        self.engine = EmbeddedEngine(config, dtype=dtype)
        self.weight_version = "default"
        # SGLang keeps weight_version as a label: a later run may push "0" after "400". The
        # embedded engine's own version (which never moves back) counts the loads instead.
        self.loads = 0
        self.running = asyncio.Event()
        self.running.set()
        self.lock = asyncio.Lock()  # one engine call (generate or load) at a time
        self.groups: dict[str, Any] = {}  # weight groups joined: name -> process group
        # a distributed update's tensors so far (weight_version, name -> tensor): the engine
        # loads whole weight sets, SGLang's buckets each bring a part
        self.pending: tuple[str, dict[str, Any]] = ("", {})
        self.weight_names = frozenset(self.engine.model.state_dict())


def build_app(state: ServeState):
    """The aiohttp application serving ``state`` (routes in the module docstring)."""
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            return _error(400, f"body is not JSON: {exc}")
        try:
            batch = parse_generate_request(body)
        except ValueError as exc:
            return _error(400, str(exc))
        if state.engine.version is None:
            return _error(400, "no weights loaded yet: POST /update_weights_from_disk first")
        await state.running.wait()
        async with state.lock:
            version = state.weight_version
            try:
                gens = await asyncio.to_thread(
                    state.engine.generate, [list(p) for p in batch.prompts], batch.params,
                    max_new_tokens=batch.max_new_tokens, eos_token_id=batch.eos_token_id,
                    seed=batch.seed, traces=batch.traces)
            except ValueError as exc:  # EngineInputError, SamplingParamsError
                return _error(400, f"{type(exc).__name__}: {exc}")
        items = [encode_item(g, rid=rid, prompt_len=len(p), config=state.config,
                             request=batch, weight_version=version)
                 for g, rid, p in zip(gens, batch.rids, batch.prompts)]
        single = not isinstance(body.get("input_ids", [[]])[0], list)
        return _json_response(items[0] if single else items)

    async def update_weights_from_disk(request: web.Request) -> web.Response:
        from safetensors.torch import load_file  # bf16 files too (numpy has no bf16)

        body = await request.json()
        path, version = body.get("model_path"), body.get("weight_version")
        if not isinstance(version, str) or not version.isdigit():
            return _json_response({"success": False, "message": f"weight_version must be a "
                                      f"decimal policy version, got {version!r}",
                                      "num_paused_requests": 0}, status=400)
        files = sorted(Path(str(path)).glob("*.safetensors")) if path else []
        if not files:
            return _json_response({"success": False, "message": f"no *.safetensors in "
                                      f"model_path {path!r}", "num_paused_requests": 0},
                                     status=400)
        arrays: dict[str, Any] = {}
        for f in files:
            arrays.update(load_file(str(f)))
        refused = await load(arrays, version)
        if refused is not None:
            return refused
        return _json_response({"success": True, "message": f"Succeeded to update model "
                                  f"weights. Weight version updated to {version}.",
                                  "num_paused_requests": 0})

    async def load(arrays: dict[str, Any], version: str):
        """Load ``arrays`` as weight version ``version`` (the engine counts loads); the error
        reply when the engine refuses them, else None."""
        async with state.lock:
            try:
                await asyncio.to_thread(state.engine.load_weights, arrays,
                                        version=state.loads + 1)
            except (CheckpointError, EngineError) as exc:  # the old weights stay
                return _json_response({"success": False, "message": f"{type(exc).__name__}: "
                                          f"{exc}", "num_paused_requests": 0}, status=400)
            state.loads += 1
            state.weight_version = version
        return None

    async def init_weights_update_group(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            name, backend = str(body["group_name"]), str(body.get("backend", "nccl"))
            spec = dict(backend=backend, master_address=str(body["master_address"]),
                        master_port=int(body["master_port"]), rank=int(body["rank_offset"]),
                        world_size=int(body["world_size"]), group_name=name,
                        timeout_s=float(body.get("timeout_s", 600.0)))
        except (KeyError, TypeError, ValueError) as exc:
            return _json_response({"success": False, "message": f"bad request: {exc!r}"}, 400)
        if name in state.groups:
            return _json_response({"success": False, "message": f"group {name} already joined"},
                                  400)
        if backend != dist_group.group_backend(getattr(state.engine, "device", "cpu")):
            return _json_response({"success": False, "message": f"backend {backend} does not "
                                   f"reach this server's device"}, 400)
        try:
            state.groups[name] = await in_daemon_thread(lambda: dist_group.join_group(**spec))
        except WeightSyncError as exc:
            return _json_response({"success": False, "message": str(exc)}, 400)
        return _json_response({"success": True, "message": f"Succeeded to initialize custom "
                                  f"process group {name}."})

    async def update_weights_from_distributed(request: web.Request) -> web.Response:
        body = await request.json()
        group = state.groups.get(body.get("group_name"))
        if group is None:
            return _json_response({"success": False, "message": f"group "
                                      f"{body.get('group_name')!r} not joined: POST "
                                      f"/init_weights_update_group first"}, 400)
        version = body.get("weight_version")
        if not isinstance(version, str) or not version.isdigit():
            return _json_response({"success": False, "message": f"weight_version must be a "
                                      f"decimal policy version, got {version!r}"}, 400)
        spec = {k: body.get(k) for k in ("names", "dtypes", "shapes")}
        device = getattr(state.engine, "device", "cpu")

        def receive() -> dict[str, Any]:
            if body.get("load_format") == "flattened_bucket":
                return dist_group.receive_bucket(spec, group, device)
            out = {}  # SGLang's default: one broadcast per tensor, each of its own dtype
            for name, dtype, shape in dist_group.check_spec(spec):
                out[name] = dist_group.receive_bucket(
                    {"names": [name], "dtypes": [str(dtype).removeprefix("torch.")],
                     "shapes": [shape]}, group, device)[name]
            return out

        try:
            arrays = await in_daemon_thread(receive)
        except WeightSyncError as exc:
            return _json_response({"success": False, "message": str(exc)}, 400)
        pending = state.pending[1] if state.pending[0] == version else {}
        pending.update(arrays)
        state.pending = (version, pending)
        if not state.weight_names <= set(pending):
            return _json_response({"success": True, "message": f"Received {len(pending)} of "
                                      f"{len(state.weight_names)} weights of version {version}."})
        state.pending = ("", {})
        refused = await load(pending, version)
        if refused is not None:
            return refused
        return _json_response({"success": True, "message": "Succeeded to update parameter "
                                  "online."})

    async def destroy_weights_update_group(request: web.Request) -> web.Response:
        body = await request.json()
        group = state.groups.pop(body.get("group_name"), None)
        if group is None:
            return _json_response({"success": False, "message": f"group "
                                      f"{body.get('group_name')!r} not joined"}, 400)
        dist_group.destroy_group(group)
        return _json_response({"success": True, "message": "Succeeded to destroy custom "
                                  "process group."})

    async def pause(request: web.Request) -> web.Response:
        state.running.clear()
        return _json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(request: web.Request) -> web.Response:
        state.running.set()
        return _json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def flush_cache(request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application(client_max_size=64 * 2 ** 20)
    app.add_routes([web.post("/generate", generate), web.put("/generate", generate),
                    web.post("/update_weights_from_disk", update_weights_from_disk),
                    web.post("/init_weights_update_group", init_weights_update_group),
                    web.post("/update_weights_from_distributed", update_weights_from_distributed),
                    web.post("/destroy_weights_update_group", destroy_weights_update_group),
                    web.post("/pause_generation", pause),
                    web.post("/continue_generation", resume),
                    web.get("/flush_cache", flush_cache), web.post("/flush_cache", flush_cache),
                    web.get("/health", health), web.get("/health_generate", health)])
    return app


async def serve(config: ModelConfig, dtype: str, host: str, port: int,
                ready: Any = print) -> None:
    """Serve until cancelled; calls ``ready(url)`` once the socket is bound."""
    import socket

    from aiohttp import web

    runner = web.AppRunner(build_app(ServeState(config, dtype)), access_log=None)
    await runner.setup()
    sock = socket.create_server((host, port))  # bound here: port 0 = the one the OS chose
    await web.SockSite(runner, sock).start()
    ready(f"http://{host}:{sock.getsockname()[1]}")
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(args: argparse.Namespace) -> int:
    """``replayrl serve``: the run flags of :data:`replayrl.tools.cli.SERVE_RUN_FLAGS` choose the
    policy's shape and the engine's precision and threads (as in ``train``); prints
    ``serving on URL`` once listening."""
    import torch

    from replayrl.tools.run.from_flags import config_from_args

    config = config_from_args(args)
    torch.set_num_threads(config.engine_torch_threads)
    dtype = resolve_dtype(config.engine_dtype)
    asyncio.run(serve(config.policy_config, dtype, args.host, args.port,
                      ready=lambda url: print(f"serving on {url}", flush=True)))
    return 0
