"""scripts/launch/secrets-init.sh (the default compose stack's `secrets-init`): three random secrets on the first
run, readable by their owner alone, kept on later runs, never printed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "launch" / "secrets-init.sh"
NAMES = ("express_node_token", "expresslane_peer_secret", "vllm_api_key")


def _run(folder: Path) -> str:
    env = {**os.environ, "SECRETS_DIR": str(folder), "SECRETS_OWNER": f"{os.getuid()}:{os.getgid()}"}
    p = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout + p.stderr


def test_generates_three_private_secrets_once(tmp_path):
    folder = tmp_path / "secrets"
    out = _run(folder)
    values = {n: (folder / n).read_text() for n in NAMES}
    assert all(len(v) >= 40 for v in values.values()) and len(set(values.values())) == 3
    assert all((folder / n).stat().st_mode & 0o777 == 0o400 for n in NAMES)
    assert not any(v in out for v in values.values()) and out.count("generated") == 3
    again = _run(folder)
    assert {n: (folder / n).read_text() for n in NAMES} == values and again.count("kept") == 3
