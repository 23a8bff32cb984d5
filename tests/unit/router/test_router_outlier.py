"""Outlier detection as a pure state machine (outlier.py) on a hand-moved clock: the rules that eject, the guards
that refuse (last serving node, max_ejection_percent), panic, ejection time growing and shrinking, membership."""

from __future__ import annotations

from expresslane.router.fleet.outlier import NodeState, OutlierConfig, OutlierDetector


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


def test_one_failure_under_load_ejects_nothing():
    d, _ = detector()
    assert d.failure("a", "transport", "server disconnected", up_all) is None
    assert d.admits("a", up_all) and d.state("a") is NodeState.SERVING


def test_consecutive_failures_eject_a_node_for_the_base_time_with_its_cause():
    d, clock = detector(consecutive_failures=3, base_ejection_s=5)
    assert d.failure("a", "connect", "x", up_all) is None
    d.success("a")  # a success breaks the run
    for _ in range(2):
        assert d.failure("a", "connect", "x", up_all) is None
    dec = d.failure("a", "transport", "RemoteProtocolError: Server disconnected", up_all)
    assert (dec.action, dec.reason, dec.failure, dec.ejected_for_s) == ("eject", "consecutive_failures", "transport", 5)
    assert "Server disconnected" in dec.describe()
    assert not d.admits("a", up_all) and d.admits("b", up_all)
    assert d.failure("a", "connect", "x", up_all) is None  # already ejected: no second decision
    clock.t += 4.9
    assert not d.admits("a", up_all) and d.readmissions() == []
    clock.t += 0.1
    assert d.admits("a", up_all)
    assert [(r.node, r.action) for r in d.readmissions()] == [("a", "readmit")]
    assert d.readmissions() == []  # reported once


def test_the_last_serving_node_is_never_ejected_for_request_errors():
    d, _ = detector(nodes=("only",), consecutive_failures=2)
    d.failure("only", "timeout", "t", up_all)
    dec = d.failure("only", "timeout", "t", up_all)
    assert (dec.action, dec.reason) == ("keep", "last_serving_node")
    assert d.admits("only", up_all)
    # two nodes, but the other is down by the probes: this one is the last serving node too
    d2, _ = detector(consecutive_failures=1)
    dec = d2.failure("a", "transport", "x", lambda n: n != "b")
    assert (dec.action, dec.reason) == ("keep", "last_serving_node") and d2.admits("a", up_all)


def test_max_ejection_percent_bounds_the_ejected_share():
    d, _ = detector(nodes=("a", "b", "c", "d"), consecutive_failures=1, max_ejection_percent=50)
    assert d.failure("a", "connect", "x", up_all).action == "eject"
    assert d.failure("b", "connect", "x", up_all).action == "eject"
    dec = d.failure("c", "connect", "x", up_all)
    assert (dec.action, dec.reason) == ("keep", "max_ejection_percent")
    assert d.ejected() == ["a", "b"]


def test_failure_percentage_over_an_interval():
    d, clock = detector(consecutive_failures=100, failure_percentage=50, request_volume=10, interval_s=10)
    for i in range(5):  # alternate: never two in a row; the 5th failure makes 10 requests, 50 % failed
        d.success("a")
        dec = d.failure("a", "http_503", "busy", up_all)
        assert dec is None if i < 4 else (dec.action, dec.reason) == ("eject", "failure_percentage")
    # a new interval restarts the counts
    d2, clock2 = detector(consecutive_failures=100, failure_percentage=50, request_volume=4, interval_s=10)
    d2.failure("a", "x", "", up_all)
    d2.failure("a", "x", "", up_all)
    clock2.t += 10
    d2.success("a")
    d2.success("a")
    assert d2.failure("a", "x", "", up_all) is None  # 1 of 3 in this interval


def test_panic_routes_to_every_up_node():
    d, _ = detector(nodes=("a", "b"), consecutive_failures=1, panic_threshold_percent=50)
    d.failure("a", "connect", "x", up_all)
    assert not d.admits("a", up_all)
    # the probes take b down: the ejected a is all that is left, and panic admits it
    b_down = lambda n: n != "b"  # noqa: E731
    assert d.panic(b_down) and d.admits("a", b_down)


def test_ejection_time_grows_with_repeats_and_shrinks_after_quiet_intervals():
    d, clock = detector(consecutive_failures=1, base_ejection_s=2, max_ejection_s=5, interval_s=10)
    assert d.failure("a", "c", "", up_all).ejected_for_s == 2
    clock.t += 2
    d.readmissions()
    assert d.failure("a", "c", "", up_all).ejected_for_s == 4
    clock.t += 4
    d.readmissions()
    assert d.failure("a", "c", "", up_all).ejected_for_s == 5  # capped at max_ejection_s
    clock.t += 5
    d.readmissions()
    clock.t += 20  # two quiet intervals: the multiplier drops from 3 to 1
    d.success("a")
    assert d.failure("a", "c", "", up_all).ejected_for_s == 4  # 1 + 1 = 2 x base


def test_disabled_never_decides_and_membership_changes():
    d, _ = detector(enabled=False, consecutive_failures=1)
    assert d.failure("a", "c", "", up_all) is None and d.admits("a", up_all)
    d2, _ = detector(consecutive_failures=1)
    d2.failure("a", "c", "", up_all)
    d2.set_nodes(["a", "c"])  # b left, c joined; a keeps its ejection
    assert d2.nodes == ["a", "c"] and not d2.admits("a", up_all) and d2.admits("c", up_all)
    assert d2.failure("gone", "c", "", up_all) is None
