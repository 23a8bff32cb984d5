"""The several-users bench (decode/bench_users.py) end to end on the tiny random shape: one JSON row per context,
speculation setting and user count, each user's tokens checked against its run alone."""

from __future__ import annotations

import json

import pytest

from expresslane.engine.decode import bench_users


def test_rows_per_user_count_and_every_user_exact(tmp_path, capsys):
    out = tmp_path / "users.jsonl"
    bench_users.main(["--random-shape", "tiny", "--contexts", "24,40", "--users", "2,3", "--tokens", "6",
                      "--speculation", "on,off", "--repeats", "1", "--no-bound", "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["context"], r["speculation"], r["users"]) for r in rows] == [
        (c, s, u) for c in (24, 40) for s in (True, False) for u in (1, 2, 3)]
    assert all(r["exact_vs_alone"] for r in rows)
    assert all(r["x_solo"] == 1.0 for r in rows if r["users"] == 1)
    assert all(r["aggregate_tok_per_s"] == pytest.approx(r["users"] * r["per_user_tok_per_s"]) for r in rows)
    # three users shared forwards: every step ran more than one user's row
    assert all(max(map(int, r["rows_histogram"])) >= 3 for r in rows if r["users"] == 3)
    assert "context=40 users=3 speculation=off" in capsys.readouterr().out


def test_recorded_text_prompts_are_rotated_per_user():
    text = list(range(10))
    a, b = bench_users.user_prompts(2, 25, 512, text)
    assert len(a) == len(b) == 25 and a != b and a[:10] == text
