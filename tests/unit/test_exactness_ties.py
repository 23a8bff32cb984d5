"""The integration tests' tie rule (tests/integration/fault_support.py): a lane's greedy answer that leaves the
single server's passes only where, at the first token it does not continue, the text it continues with is one
of the server's alternatives there within TIE_NATS. The server's steps are what vLLM's completions logprobs give:
(token text, its logprob, the top alternatives' logprobs by token text)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from fault_support import TIE_NATS, tie_at_first_difference  # noqa: E402

# The case seen in a CPU burst (2026-12-05): after " again" the server took " gr" at 86.2759, "inter" was 86.2755.
STEPS = [(" the", -0.1, {" the": -0.1, " a": -3.0}),
         ("ud", -0.2, {"ud": -0.2, "ue": -2.5}),
         (" again", -0.3, {" again": -0.3, " agre": -0.74}),
         (" gr", -0.6930, {" gr": -0.6930, "inter": -0.6934, " so": -4.0}),
         ("f", -0.05, {"f": -0.05})]


def test_the_same_answer_is_no_difference():
    assert tie_at_first_difference(STEPS, " theud again grf") == (True, "the server's answer with logprobs is the lane's")


def test_a_difference_at_a_rounding_tie_passes():
    tie, why = tie_at_first_difference(STEPS, " theud againinterotult")
    assert tie, why
    assert "'inter'" in why and "token 3" in why


def test_a_difference_where_the_gap_is_wide_fails():
    tie, why = tie_at_first_difference(STEPS, " theud agree to")  # " agre" is 0.44 nats below " again"
    assert not tie and "token 2" in why
    tie, why = tie_at_first_difference(STEPS, " theud again so")  # " so" is 3.3 nats below " gr"
    assert not tie and "token 3" in why


def test_a_token_no_alternative_names_fails():
    tie, why = tie_at_first_difference(STEPS, " thexyz")
    assert not tie and "token 1" in why


def test_a_longer_or_shorter_answer_is_not_a_tie():
    assert tie_at_first_difference(STEPS, " theud again grf and more")[0] is False
    assert tie_at_first_difference(STEPS, " theud")[0] is False


def test_the_bound_is_rounding_not_a_preference():
    assert 0 < TIE_NATS <= 0.01
