"""Outlier detection as a pure state machine (fleet/outlier.py) on a hand-moved clock, read against Envoy's: the
outcome classes, consecutive_5xx and consecutive_gateway_failure, successes breaking a run, the failure percentage,
the guards that refuse (last serving node, max_ejection_percent) and how often they say so, ejection time growing
and shrinking only after an ejection ends, ejections ended by a passing probe, membership. Each case of issue 42's
"Outlier detection, read against Envoy" that is a state machine's has a test here that fails without its fix."""

from __future__ import annotations

import pytest

from expresslane.router.fleet.outlier import FailureClass, NodeState, OutlierConfig, OutlierDetector, classify


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def up_all(node: str) -> bool:
    return True


def detector(nodes=("a", "b"), **cfg):
    clock = Clock()
    return OutlierDetector("p", nodes, OutlierConfig(**cfg), clock), clock


@pytest.mark.parametrize("kind,want", [
    ("connect", FailureClass.GATEWAY), ("timeout", FailureClass.GATEWAY), ("stall", FailureClass.GATEWAY),
    ("transport", FailureClass.GATEWAY), ("not_ready", FailureClass.GATEWAY), ("http_502", FailureClass.GATEWAY),
    ("http_503", FailureClass.GATEWAY), ("http_504", FailureClass.GATEWAY), ("http_500", FailureClass.SERVER),
    ("http_501", FailureClass.SERVER), ("deadline", None), ("router_saturated", None), ("node_busy", None),
    ("http_429", None), ("http_400", None), ("bad_reply", None), ("truncated", None), ("no_healthy_node", None)])
def test_outcome_classes(kind, want):
    """Envoy's classes: gateway failures (local origin, 502/503/504), other 5xx; the request's deadline, the router's
    own saturation, a busy node, a client error are never the node's."""
    assert classify(kind) is want


def test_one_failure_under_load_ejects_nothing():
    d, _ = detector()
    assert d.failure("a", "transport", "server disconnected", up_all) is None
    assert d.admits("a") and d.state("a") is NodeState.SERVING


def test_consecutive_gateway_failures_eject_a_node_for_the_base_time_with_its_cause():
    d, clock = detector(consecutive_gateway_failure=3, base_ejection_time_s=5)
    assert d.failure("a", "connect", "x", up_all) is None
    d.success("a")  # a success breaks the run
    for _ in range(2):
        assert d.failure("a", "connect", "x", up_all) is None
    dec = d.failure("a", "transport", "RemoteProtocolError: Server disconnected", up_all)
    assert (dec.action, dec.reason, dec.failure, dec.ejected_for_s) == (
        "eject", "consecutive_gateway_failure", "transport", 5)
    assert "Server disconnected" in dec.describe()
    assert not d.admits("a") and d.admits("b")
    assert d.failure("a", "connect", "x", up_all) is None  # already ejected: no second decision
    clock.t += 4.9
    assert not d.admits("a") and d.readmissions() == []
    clock.t += 0.1
    assert d.admits("a")
    assert [(r.node, r.action) for r in d.readmissions()] == [("a", "readmit")]
    assert d.readmissions() == []  # reported once


def test_a_node_that_answers_500_at_once_is_ejected_by_consecutive_5xx():
    """Issue 42 item 2: only connect / timeout / stall / transport counted, so a node answering 500 at once was never
    ejected (and least-outstanding choice sent it most traffic). Envoy's consecutive_5xx counts every 5xx."""
    d, _ = detector(consecutive_5xx=5, consecutive_gateway_failure=3)
    for i in range(4):
        assert d.failure("a", "http_500", "boom", up_all) is None, i
    dec = d.failure("a", "http_500", "boom", up_all)
    assert (dec.action, dec.reason) == ("eject", "consecutive_5xx")
    # a 500 breaks a run of gateway failures but joins the 5xx run
    d2, _ = detector(consecutive_5xx=5, consecutive_gateway_failure=3)
    d2.failure("a", "http_503", "", up_all)
    d2.failure("a", "http_503", "", up_all)
    assert d2.failure("a", "http_500", "", up_all) is None
    assert d2.failure("a", "http_502", "", up_all) is None  # gateway run restarted at 1
    assert d2.failure("a", "connect", "", up_all).reason == "consecutive_5xx"  # fifth 5xx-or-gateway in a row


def test_failures_that_are_not_the_nodes_are_never_counted():
    d, _ = detector(consecutive_5xx=1, consecutive_gateway_failure=1)
    for kind in ("deadline", "router_saturated", "node_busy", "http_429", "http_400"):
        assert d.failure("a", kind, "", up_all) is None
    assert d.admits("a")


def test_successes_keep_a_mostly_good_member_in():
    """Issue 42 item 1: prefill members never reported a success, so the failure percentage was always 100 % and a
    member with 95 % success was ejected after 100 calls. With every completed leg reported, 1 failure in 20 ejects
    nothing."""
    d, clock = detector(failure_percentage_threshold=85, failure_percentage_request_volume=20, interval_s=1000)
    for i in range(400):
        if i % 20 == 19:
            assert d.failure("a", "timeout", "one leg in twenty", up_all) is None
        else:
            d.success("a")
    assert d.admits("a")


def test_failure_percentage_over_an_interval():
    d, clock = detector(consecutive_5xx=None, consecutive_gateway_failure=None, failure_percentage_threshold=50,
                        failure_percentage_request_volume=10, interval_s=10)
    for i in range(5):  # alternate: never two in a row; the 5th failure makes 10 requests, 50 % failed
        d.success("a")
        dec = d.failure("a", "http_503", "busy", up_all)
        assert dec is None if i < 4 else (dec.action, dec.reason) == ("eject", "failure_percentage")
    # a new interval restarts the counts
    d2, clock2 = detector(consecutive_5xx=None, consecutive_gateway_failure=None, failure_percentage_threshold=50,
                          failure_percentage_request_volume=4, interval_s=10)
    d2.failure("a", "timeout", "", up_all)
    d2.failure("a", "timeout", "", up_all)
    clock2.t += 10
    d2.success("a")
    d2.success("a")
    assert d2.failure("a", "timeout", "", up_all) is None  # 1 of 3 in this interval
    # fewer members than failure_percentage_minimum_hosts: the rule does not apply
    d3, _ = detector(nodes=("a", "b"), consecutive_5xx=None, consecutive_gateway_failure=None,
                     failure_percentage_threshold=50, failure_percentage_request_volume=2,
                     failure_percentage_minimum_hosts=3)
    for _ in range(6):
        assert d3.failure("a", "timeout", "", up_all) is None


def test_the_last_serving_node_is_never_ejected_for_request_errors():
    d, _ = detector(nodes=("only",), consecutive_gateway_failure=2)
    d.failure("only", "timeout", "t", up_all)
    dec = d.failure("only", "timeout", "t", up_all)
    assert (dec.action, dec.reason) == ("keep", "last_serving_node")
    assert d.admits("only")
    # two nodes, but the other is down by the probes: this one is the last serving node too
    d2, _ = detector(consecutive_gateway_failure=1)
    dec = d2.failure("a", "transport", "x", lambda n: n != "b")
    assert (dec.action, dec.reason) == ("keep", "last_serving_node") and d2.admits("a")


def test_a_refused_ejection_is_reported_once_per_interval():
    """Issue 42 item 6: a refused ejection fired again on every later failure (one WARNING and one metric per failed
    request). Now once per node per interval."""
    d, clock = detector(nodes=("only",), consecutive_gateway_failure=2, interval_s=10)
    decisions = [d.failure("only", "connect", "", up_all) for _ in range(50)]
    assert [x.action for x in decisions if x is not None] == ["keep"]
    clock.t += 10
    assert d.failure("only", "connect", "", up_all).action == "keep"  # the next interval: once more
    assert d.failure("only", "connect", "", up_all) is None


def test_max_ejection_percent_bounds_the_ejected_share():
    d, _ = detector(nodes=("a", "b", "c", "d"), consecutive_gateway_failure=1, max_ejection_percent=50)
    assert d.failure("a", "connect", "x", up_all).action == "eject"
    assert d.failure("b", "connect", "x", up_all).action == "eject"
    dec = d.failure("c", "connect", "x", up_all)
    assert (dec.action, dec.reason) == ("keep", "max_ejection_percent")
    assert d.ejected() == ["a", "b"]


def test_ejection_time_grows_with_repeats_and_shrinks_after_quiet_intervals():
    d, clock = detector(consecutive_gateway_failure=1, base_ejection_time_s=2, max_ejection_time_s=5,
                        interval_s=10)
    assert d.failure("a", "connect", "", up_all).ejected_for_s == 2
    clock.t += 2
    d.readmissions()
    assert d.failure("a", "connect", "", up_all).ejected_for_s == 4
    clock.t += 4
    d.readmissions()
    assert d.failure("a", "connect", "", up_all).ejected_for_s == 5  # capped at max_ejection_time_s
    clock.t += 5
    d.readmissions()
    clock.t += 20  # two quiet intervals after the ejection ended: the multiplier drops from 3 to 1
    d.success("a")
    assert d.failure("a", "connect", "", up_all).ejected_for_s == 4  # 1 + 1 = 2 x base


def test_the_multiplier_never_decays_during_an_ejection():
    """Issue 42 item 5: an outcome that arrived before the re-admission sweep decayed the multiplier by the intervals
    spent ejected: times_ejected went 5 -> 0 after one 50 s ejection. Only intervals served after it count."""
    d, clock = detector(consecutive_gateway_failure=1, base_ejection_time_s=10, max_ejection_time_s=100,
                        interval_s=10)
    for _ in range(5):
        dec = d.failure("a", "connect", "", up_all)
        clock.t += dec.ejected_for_s
        d.readmissions()
    assert d.times_ejected("a") == 5  # the last one lasted 50 s
    d.failure("a", "connect", "", up_all)  # the sixth: 60 s
    clock.t += 61  # over, and an outcome arrives before the sweep
    d.success("a")
    assert d.times_ejected("a") == 6
    clock.t += 9  # 10 s served since it ended: one step
    assert d.times_ejected("a") == 5


def test_uneject_by_an_active_health_check():
    d, clock = detector(consecutive_gateway_failure=1, base_ejection_time_s=30)
    d.failure("a", "connect", "", up_all)
    dec = d.uneject("a")
    assert (dec.action, dec.reason) == ("readmit", "active_health_check") and d.admits("a")
    assert d.uneject("a") is None and d.readmissions() == []  # once
    off, _ = detector(consecutive_gateway_failure=1, successful_active_health_check_uneject_host=False)
    off.failure("a", "connect", "", up_all)
    assert off.uneject("a") is None and not off.admits("a")


def test_disabled_never_decides_and_membership_changes():
    d, _ = detector(enabled=False, consecutive_gateway_failure=1)
    assert d.failure("a", "connect", "", up_all) is None and d.admits("a")
    d2, _ = detector(consecutive_gateway_failure=1)
    d2.failure("a", "connect", "", up_all)
    d2.set_nodes(["a", "c"])  # b left, c joined; a keeps its ejection
    assert d2.nodes == ["a", "c"] and not d2.admits("a") and d2.admits("c")
    assert d2.failure("gone", "connect", "", up_all) is None
