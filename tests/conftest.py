"""Shared pytest fixtures.

`live_stack` starts the real stack (stock vLLM prefill + native decode, our express decode server, the
router) once per session with scripts/dev_stack.py, on ports shifted by EXPRESSLANE_TEST_PORT_BASE
(default 20000) so a developer's own stack on the default ports is left alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from dev_stack import DevStack  # noqa: E402


def _run_order(item) -> int:
    """compose (its own Docker stack, torn down by the test), the unit tests, the integration modules with their
    own stack, then the ones on the session's `live_stack`. The live stack's two vLLM servers busy-poll a core
    each (their NIXL progress threads) from start to session end: started before the unit tests, they left them
    and any stack started meanwhile a fraction of the CPU (the secured stack's setup took 600 s beside it, 56 s
    alone; the unit tests ran about 1.4x slower)."""
    path = str(item.fspath)
    if "/compose/" in path:
        return 0
    if "/integration/" not in path:
        return 1
    return 3 if "live_stack" in getattr(item, "fixturenames", ()) else 2


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
    items.sort(key=_run_order)  # stable: the order inside each group (and module) is kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the item (`item.rep_call`, ...), for fixtures that add evidence on failure."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The embedded default model, generated once (deterministic, float32)."""
    cached = os.environ.get("EXPRESSLANE_TEST_MODEL_DIR")
    model_dir = Path(cached) if cached else REPO / "var" / "models" / "tiny-llama"
    import subprocess

    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(model_dir), "--dtype", "float32"],
        check=True,
    )
    return model_dir


@pytest.fixture(scope="session")
def live_stack(tiny_model_dir, tmp_path_factory):
    base = int(os.environ.get("EXPRESSLANE_TEST_PORT_BASE", "20000"))
    state = tmp_path_factory.mktemp("dev-stack")
    stack = DevStack(model_dir=tiny_model_dir, state_dir=state, port_base=base)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
        if os.environ.get("EXPRESSLANE_TEST_SHOW_LOGS"):
            for name in stack.services:
                print(f"\n===== {name} log tail =====\n{stack.log_tail(name, 40)}")
