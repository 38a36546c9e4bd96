"""An aiohttp app on a free loopback port, for tests that stand a fake worker or router behind real HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from sgl_multilora.server import free_port


@contextlib.asynccontextmanager
async def local_app(*routes: tuple[str, str, Callable]) -> AsyncIterator[str]:
    """Serves `routes` ((method, path, handler) triples) for the block's duration; yields the app's base URL."""
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
