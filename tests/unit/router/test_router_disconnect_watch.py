"""app.run_until_disconnect runs the work in the request's own task with one watcher: the work's result when it ends
first; on a client disconnect the work is cancelled, its cleanup has run when ClientGone is raised, and the
request's task is left with no cancellation pending (it still awaits and answers afterwards)."""

from __future__ import annotations

import asyncio

import pytest

from expresslane.router.app import run_until_disconnect
from expresslane.router.errors import ClientGone
from expresslane.router.server.http_protocol import ClientWatch

from ._asgi import Serving, free_port, serve_lifespan


def _receive(disconnect: asyncio.Event):
    async def receive() -> dict:
        await disconnect.wait()
        return {"type": "http.disconnect"}
    return receive


async def test_the_work_ends_first_and_its_result_is_returned():
    gone = asyncio.Event()

    async def work() -> str:
        await asyncio.sleep(0.01)
        return "reply"

    assert await run_until_disconnect(_receive(gone), work()) == "reply"
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)  # the task can still await


async def _hangs_then_cleans_up(events: list[str]) -> str:
    """Work that never ends by itself, with a cleanup that itself awaits (it must run to its end)."""
    try:
        await asyncio.sleep(30)
        return "never"
    finally:
        events.append("cleanup")
        await asyncio.sleep(0.01)
        events.append("cleanup done")


async def test_a_disconnect_cancels_the_work_after_its_cleanup_and_leaves_the_task_usable():
    gone = asyncio.Event()
    events: list[str] = []


    asyncio.get_running_loop().call_later(0.05, gone.set)
    with pytest.raises(ClientGone):
        await run_until_disconnect(_receive(gone), _hangs_then_cleans_up(events))
    assert events == ["cleanup", "cleanup done"]
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0.01)  # no cancellation is left pending on the request's task


async def test_a_cancel_from_outside_is_not_a_client_disconnect():
    gone = asyncio.Event()

    async def work() -> str:
        await asyncio.sleep(30)
        return "never"

    task = asyncio.ensure_future(run_until_disconnect(_receive(gone), work()))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_watcher_is_gone_after_the_work():
    gone = asyncio.Event()
    before = len(asyncio.all_tasks())

    async def work() -> str:
        return "reply"

    await run_until_disconnect(_receive(gone), work())
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before


# ---- the same with the server's ClientWatch (http_protocol.py): no watcher task -----------------------------------

async def test_with_a_client_watch_the_work_ends_first_and_no_task_is_made():
    watch = ClientWatch()
    never = asyncio.Event()
    before = len(asyncio.all_tasks())
    seen: list[int] = []

    async def work() -> str:
        seen.append(len(asyncio.all_tasks()))
        await asyncio.sleep(0.01)
        return "reply"

    assert await run_until_disconnect(_receive(never), work(), watch) == "reply"
    assert seen == [before]  # no watcher task beside the work
    assert asyncio.current_task().cancelling() == 0
    watch.lost()  # after the work: told to nobody, cancels nothing
    await asyncio.sleep(0.01)


async def test_a_lost_connection_cancels_the_work_after_its_cleanup():
    watch = ClientWatch()
    events: list[str] = []


    asyncio.get_running_loop().call_later(0.05, watch.lost)
    with pytest.raises(ClientGone):
        await run_until_disconnect(_receive(asyncio.Event()), _hangs_then_cleans_up(events), watch)
    assert events == ["cleanup", "cleanup done"]
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0.01)


async def test_a_connection_already_lost_ends_the_request_at_once():
    watch = ClientWatch()
    watch.lost()

    async def work() -> str:
        await asyncio.sleep(30)
        return "never"

    with pytest.raises(ClientGone):
        await asyncio.wait_for(run_until_disconnect(_receive(asyncio.Event()), work(), watch), 10)


def test_the_server_tells_the_watch_when_the_client_goes():
    """A real RouterServer: the client sends a request and closes its socket while the work runs; the work must be
    cancelled (it would sleep 60 s) through the scope's ClientWatch, with no watcher task."""
    import socket
    import threading

    import uvicorn

    from expresslane.router.server.http_protocol import client_watch
    from expresslane.router.server.serving import RouterServer

    events: list[str] = []
    started = threading.Event()
    ended = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await serve_lifespan(receive, send)
        await receive()  # the body
        watch = client_watch(scope)
        events.append("watch" if watch is not None else "no watch")

        async def work():
            started.set()
            await asyncio.sleep(60)

        try:
            await run_until_disconnect(receive, work(), watch)
        except ClientGone:
            events.append("gone")
        finally:
            ended.set()

    port = free_port()
    serving = Serving(RouterServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                  log_config=None, http="httptools", loop="uvloop")))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            assert started.wait(20)
        assert ended.wait(20)  # generous: CI is slower; without the watch's call the work sleeps 60 s
        assert events == ["watch", "gone"]
    finally:
        serving.stop()
