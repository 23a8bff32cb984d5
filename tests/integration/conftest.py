"""Fixtures shared by the integration tests (the stack itself: tests/conftest.py `live_stack`)."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def http():
    """One pooled client with explicit timeouts (a 1.5k-token prefill on a loaded 2-core CPU is slow)."""
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as c:
        yield c
