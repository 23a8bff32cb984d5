"""The alert and recording rules (compose/prometheus/rules/): valid for promtool, their unit tests pass, and
every metric they use is one the dashboards' metric contract (scripts/dashboards.py METRICS) knows.

promtool comes from PROMTOOL_BIN (scripts/test.sh unpacks Debian's prometheus package and sets it) or PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import dashboards  # noqa: E402

RULES = sorted((REPO / "compose" / "prometheus" / "rules").glob("*.yml"))
RULE_TESTS = sorted((REPO / "compose" / "prometheus" / "rules" / "tests").glob("*.yml"))
PAGED_ON = {"ExpressNodeDown", "ExpressNodeUnhealthy", "UpstreamEjected", "HandoffFailures", "StagingExhausted",
            "ExpressQueueSaturated", "NativeQueueSaturated", "TTFTBudgetBurnFast", "TTFTBudgetBurnSlow",
            "ITLBudgetBurnFast", "ITLBudgetBurnSlow"}


def promtool() -> str:
    binary = os.environ.get("PROMTOOL_BIN") or shutil.which("promtool")
    if not binary:
        pytest.skip("no promtool (scripts/test.sh provides one: PROMTOOL_BIN)")
    return binary


def run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([promtool(), *args], text=True, capture_output=True, timeout=120, cwd=REPO)
    print(proc.stdout, proc.stderr)
    return proc


def rules() -> list[dict]:
    return [r for f in RULES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]


def test_rule_files_exist_and_tests_exist():
    assert RULES and RULE_TESTS


def test_promtool_check_rules():
    proc = run("check", "rules", *map(str, RULES))
    assert proc.returncode == 0


def test_promtool_test_rules():
    proc = run("test", "rules", *map(str, RULE_TESTS))
    assert proc.returncode == 0


def test_a_broken_expectation_fails(tmp_path):
    """The unit tests can fail: the same test file with one expected alert's label changed is rejected."""
    text = RULE_TESTS[0].read_text().replace("../expresslane.yml", str(RULES[0]))
    assert "lane: express}" in text
    broken = tmp_path / "broken_test.yml"
    broken.write_text(text.replace("lane: express}", "lane: native}", 1))
    assert run("test", "rules", str(broken)).returncode != 0


def test_every_operator_alert_is_there_and_tested():
    names = {r["alert"] for r in rules() if "alert" in r}
    assert PAGED_ON <= names, PAGED_ON - names
    tested = {t["alertname"] for f in RULE_TESTS for case in yaml.safe_load(f.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    assert {"ExpressNodeDown", "UpstreamEjected", "HandoffFailures", "StagingExhausted", "ExpressQueueSaturated",
            "TTFTBudgetBurnFast", "ITLBudgetBurnFast"} <= tested


def test_every_metric_in_the_rules_is_known():
    recorded = {r["record"] for r in rules() if "record" in r}
    unknown = set()
    for r in rules():
        for name in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", r["expr"]):
            if name in recorded or not (name.startswith(("expresslane_", "vllm:")) or name == "up"):
                continue
            if dashboards.resolve_metric(name) is None:
                unknown.add(name)
    assert not unknown, f"not in scripts/dashboards.py METRICS: {sorted(unknown)}"


def test_every_alert_has_severity_and_summary():
    for r in rules():
        if "alert" in r:
            assert r["labels"]["severity"] in {"page", "ticket"}, r["alert"]
            assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
