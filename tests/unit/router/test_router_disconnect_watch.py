"""app.run_until_disconnect runs the work in the request's own task with one watcher: the work's result when it ends
first; on a client disconnect the work is cancelled, its cleanup has run when ClientGone is raised, and the
request's task is left with no cancellation pending (it still awaits and answers afterwards)."""

from __future__ import annotations

import asyncio

import pytest

from expresslane.router.app import run_until_disconnect
from expresslane.router.errors import ClientGone


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


async def test_a_disconnect_cancels_the_work_after_its_cleanup_and_leaves_the_task_usable():
    gone = asyncio.Event()
    events: list[str] = []

    async def work() -> str:
        try:
            await asyncio.sleep(30)
            return "never"
        finally:
            events.append("cleanup")
            await asyncio.sleep(0.01)  # cleanup that itself awaits runs to its end
            events.append("cleanup done")

    asyncio.get_running_loop().call_later(0.05, gone.set)
    with pytest.raises(ClientGone):
        await run_until_disconnect(_receive(gone), work())
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
