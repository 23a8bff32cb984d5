"""The router's HTTP server: uvicorn's Server without a housekeeping tick; the Date header is made by requests;
uvicorn's httptools protocol with one write per reply (http_protocol.py).

uvicorn wakes its main loop ten times a second (to refresh the Date header once a second and to notice a
shutdown request). On this project's small hosts a wake-up of an idle process costs far more than its few lines
of Python (cold caches): the once-a-second tick it had still cost about 0.34 ms of CPU a second on an idle
router (perf stat, docs/bench/2026-12-01-router-h1pool/), which the bench's router CPU per request
counts. So `RouterServer` has no tick at all:
- the Date header: each HTTP request, before the app runs, refreshes the server's default headers in place
  when the second has changed (`refresh_date`); the request's response is built from that same list, so its
  Date is the second the request started (uvicorn's tick could be up to a second late);
- an exit request (SIGINT/SIGTERM through uvicorn's handle_exit) wakes the loop through the event loop's
  self-pipe, so stopping is immediate.
uvicorn's tick also drives `limit_max_requests` and `callback_notify`, which the router does not use
(`serve` sets neither).
"""

from __future__ import annotations

import asyncio
import gc
import time
from email.utils import formatdate
from types import FrameType

import uvicorn

from .http_protocol import RouterHttpProtocol

__all__ = ["RouterServer", "serve", "server_config"]

STARTUP_FAILURE = 3  # uvicorn.run's exit code when the app did not start


class RouterServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        config.http = RouterHttpProtocol  # one write per reply of a known length (http_protocol.py)
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._date_second = -1

    def refresh_date(self) -> None:
        """Set the Date header of the default headers (the list every request's response is built from) to
        now, in place, if the second changed since the last refresh."""
        now = time.time()
        second = int(now)
        if second != self._date_second:
            self._date_second = second
            date = [(b"date", formatdate(now, usegmt=True).encode())] if self.config.date_header else []
            self.server_state.default_headers[:] = date + self.config.encoded_headers

    async def startup(self, sockets=None) -> None:
        app, refresh = self.config.loaded_app, self.refresh_date

        async def fresh_date(scope, receive, send) -> None:
            if scope["type"] == "http":
                refresh()
            await app(scope, receive, send)

        self.config.loaded_app = fresh_date  # the protocols made from here on call it
        await super().startup(sockets)
        # Everything built so far (modules, the app, its lifespan's clients) lives as long as the process: out of
        # the collector's generations, so its collections walk only what requests allocate.
        gc.freeze()

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        gc.unfreeze()  # what startup froze is the collector's again (garbage at exit is collected as before)

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        should_exit = await self.on_tick(0)  # the default headers' list (counter 0: with the Date)
        self._date_second = -1
        while not should_exit:
            await self._wake.wait()
            self._wake.clear()
            should_exit = await self.on_tick(1)  # counter 1: the exit check only, the list is kept

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)  # a signal handler: wake the loop through its pipe


def server_config(app, *, host: str, port: int, log_level: str, keepalive_s: float) -> uvicorn.Config:
    """The router's uvicorn settings. `keepalive_s`: how long an idle client connection stays open (config
    listen.keepalive_timeout_s, 75 s; uvicorn's own default, 5 s, equals httpx's and the openai SDK's idle expiry,
    and a client reusing a connection raced the server's close: "server disconnected without sending a response").
    uvicorn arms that timer only while a connection is idle: never on one with a request in flight."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, log_config=None,
                          timeout_keep_alive=keepalive_s)


def serve(app, *, host: str, port: int, log_level: str, keepalive_s: float) -> int:
    """Serve `app` until SIGINT/SIGTERM (uvicorn.run's behaviour, our handlers for logs and access lines)."""
    server = RouterServer(server_config(app, host=host, port=port, log_level=log_level, keepalive_s=keepalive_s))
    server.run()
    return 0 if server.started else STARTUP_FAILURE
