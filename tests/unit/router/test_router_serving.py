"""serving.RouterServer: uvicorn's server without a housekeeping tick must still stop at once on an exit request
(the signal wakes the loop; no tick stands in for it), serve requests meanwhile, and give every response the
Date of its second (made by the request, not by a tick), while an idle server never wakes."""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime

import httpx
import uvicorn

from expresslane.router.server.serving import RouterServer

from ._asgi import Serving, free_port, serve_lifespan


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        return await serve_lifespan(receive, send)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


class _CountingServer(RouterServer):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


def test_an_exit_request_stops_the_server_and_an_idle_server_never_wakes():
    port = free_port()
    server = _CountingServer(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
    serving = Serving(server)  # on a thread: no signal handlers off the main thread
    r = httpx.get(f"http://127.0.0.1:{port}/", trust_env=False, timeout=10)
    assert r.status_code == 200 and r.text == "ok" and "date" in r.headers
    time.sleep(1.5)  # uvicorn's own loop would tick 15 times here, a 1 s tick once or twice
    assert server.ticks == 1  # the start only
    serving.stop()  # what uvicorn's SIGTERM handler calls; generous bound (CI is slower): without the wake-up
    assert not serving.thread.is_alive()  # this waits for the hour-long tick


def test_every_response_has_the_date_of_its_second_after_any_idle_time():
    port = free_port()
    server = RouterServer(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
    serving = Serving(server)
    try:
        with httpx.Client(trust_env=False, timeout=10) as c:  # one keep-alive connection, as a client would
            for pause in (0.0, 1.3, 2.2):
                time.sleep(pause)
                before = int(time.time())
                r = c.get(f"http://127.0.0.1:{port}/")
                after = int(time.time())
                got = int(parsedate_to_datetime(r.headers["date"]).timestamp())
                assert before <= got <= after, (pause, r.headers["date"])
                assert len(r.headers.get_list("date")) == 1
    finally:
        serving.stop()


def test_the_startup_heap_is_frozen_while_serving_and_unfrozen_after():
    import gc

    port = free_port()
    server = RouterServer(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
    serving = Serving(server)
    assert gc.get_freeze_count() > 0  # the app and everything imported: out of the collector's generations
    serving.stop()
    assert not serving.thread.is_alive() and gc.get_freeze_count() == 0
