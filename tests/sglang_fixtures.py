"""Servers on loopback for the SGLang engine tests: ``replayrl serve``'s app in a thread, and a
proxy in front of it that breaks replies in one named way (a server bug or a server death)."""
from __future__ import annotations

import asyncio
import base64
import socket
import threading
from typing import Any, Callable

from aiohttp import ClientSession, web

from replayrl.rollout.model.config import ModelConfig
from replayrl.tools.serve import ServeState, build_app


class AppThread:
    """An aiohttp application served on 127.0.0.1 (a free port) by its own event-loop thread.

    ``make_app`` runs inside that loop (so asyncio objects bind to it); ``url`` is the base
    URL; ``stop()`` closes the server.
    """

    def __init__(self, make_app: Callable[[], Any]) -> None:
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self._runner = asyncio.run_coroutine_threadsafe(self._start(make_app), self._loop).result(60)

    async def _start(self, make_app):
        runner = web.AppRunner(make_app(), access_log=None)
        await runner.setup()
        self.sock = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, self.sock).start()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        return runner

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)


def serve_thread(config: ModelConfig, dtype: str = "float32") -> AppThread:
    """``replayrl serve``'s application (the embedded engine in ``dtype``) on loopback."""
    return AppThread(lambda: build_app(ServeState(config, dtype)))


class FaultProxy:
    """Forwards every request to ``target``; ``fault(reply_items)`` may change a ``/generate``
    reply before it is returned, and ``die_on_generate`` drops the connection of the first
    ``n`` generate requests after the target received them (a server dying mid-request).

    Attributes:
        generate_calls: ``/generate`` requests seen.
    """

    def __init__(self, target: str, fault: Callable[[list], None] | None = None,
                 die_on_generate: int = 0) -> None:
        self.target, self.fault, self.die = target, fault, die_on_generate
        self.generate_calls = 0
        self.app = AppThread(self._make_app)
        self.url = self.app.url

    def _make_app(self):
        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with ClientSession() as session:
                async with session.request(request.method, self.target + request.path,
                                           data=body, headers={"Content-Type": "application/json"}
                                           ) as resp:
                    status, payload = resp.status, await resp.read()
            if request.path == "/generate":
                self.generate_calls += 1
                if self.generate_calls <= self.die:
                    request.transport.abort()  # the reply never comes: connection reset
                    raise ConnectionResetError("proxy: server died mid-request")
                if self.fault is not None and status == 200:
                    import json

                    items = json.loads(payload)
                    self.fault(items)
                    return web.json_response(items, status=status)
            return web.Response(body=payload, status=status,
                                content_type="application/json")

        app = web.Application(client_max_size=64 * 2 ** 20)
        app.router.add_route("*", "/{tail:.*}", forward)
        return app

    def stop(self) -> None:
        self.app.stop()


def corrupt_base64(text: str) -> str:
    """``text`` with a character outside the base64 alphabet in the middle."""
    return text[:4] + "*" + text[5:]


def drop_first_row(text: str, row_values: int) -> str:
    """A base64 int32 trace without its first row (``row_values`` int32 per row)."""
    raw = base64.b64decode(text)
    return base64.b64encode(raw[4 * row_values:]).decode("ascii")
