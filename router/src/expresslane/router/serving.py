"""The router's HTTP server: uvicorn's Server with a once-a-second housekeeping tick, woken at once by an exit.

uvicorn wakes its main loop ten times a second (to refresh the Date header once a second and to notice a
shutdown request): about 2 ms of CPU a second on an idle router here, which the bench's router CPU per request
counts (docs/performance.md, "Router hot path (session 3)"). `RouterServer` ticks every `tick_s` (1 s: the Date
header still changes every second) and a shutdown (SIGINT/SIGTERM through uvicorn's handle_exit) wakes the loop
through the event loop's self-pipe, so stopping never waits for a tick.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import FrameType

import uvicorn

__all__ = ["RouterServer", "serve"]

STARTUP_FAILURE = 3  # uvicorn.run's exit code when the app did not start


class RouterServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, tick_s: float = 1.0) -> None:
        super().__init__(config)
        self.tick_s = tick_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0  # on_tick refreshes the Date header when counter % 10 == 0: every tick here
        should_exit = await self.on_tick(counter)
        while not should_exit:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.tick_s):
                    await self._wake.wait()
            self._wake.clear()
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)  # a signal handler: wake the loop through its pipe


def serve(app, *, host: str, port: int, log_level: str) -> int:
    """Serve `app` until SIGINT/SIGTERM (uvicorn.run's behaviour, our handlers for logs and access lines)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, log_config=None)
    server = RouterServer(config)
    server.run()
    return 0 if server.started else STARTUP_FAILURE
