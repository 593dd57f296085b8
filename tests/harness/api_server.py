"""`ApiServer`: an aiohttp app served on 127.0.0.1 (a free port) from a thread of its own, for the tests that
stand in for a remote HTTP API the code under test calls with a blocking client (the Kubernetes API
server of tests/router/test_discovery.py and tests/router/test_k8s_scale.py). A subclass adds its routes
in `routes(app)`; `url` is where it listens; `close()` cancels what its handlers still run (a watch
stream) and stops the loop."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class ApiServer:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        if not self.ready.wait(10):
            raise RuntimeError(f"{type(self).__name__} did not start")

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        self.routes(app)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        async def shutdown():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
