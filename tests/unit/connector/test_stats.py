"""The connector's numbers through vLLM's own KV-connector stats interface, under MultiConnector as deployed:
worker + scheduler stats -> vLLM's aggregation -> the msgpack hop -> the API server's loggers -> /metrics."""

from __future__ import annotations

import re

import pytest

from .conftest import make_request, marker, step

pytest.importorskip("vllm")

DEPLOYED = {  # scripts/launch/prefill.sh's MultiConnector, less the side port
    "kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"},
        {"kv_connector": "ExpressLaneConnector", "kv_connector_module_path": "expresslane.engine.connector",
         "kv_role": "kv_producer", "kv_connector_extra_config": {"staging_slots": 3}},
    ]}}


def _metric_types(registry):
    """vLLM's metric classes, bound to a private registry (the global one would collide across tests)."""
    from prometheus_client import Counter, Gauge, Histogram

    def bind(cls):
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=registry,
                                                                                           **k)})

    return {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}


def test_payload_reaches_vllm_prometheus_metrics_under_multiconnector(model_dir) -> None:
    import msgspec
    from prometheus_client import CollectorRegistry, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector, MultiKVConnectorStats

    from expresslane.engine.connector.stats import METRICS, ExpressLaneStats

    from .conftest import make_vllm_config

    vc = make_vllm_config(model_dir, connector=DEPLOYED)
    registry = CollectorRegistry()
    prom = MultiConnector.build_prom_metrics(vc, _metric_types(registry), ["model_name", "engine"],
                                             {0: ["tiny", "0"]})
    text = generate_latest(registry).decode()
    # the gauges exist before any request, one per TP rank, with vLLM's labels
    assert 'expresslane_connector_staging_slots_free{engine="0",model_name="tiny",rank="0"} 3.0' in text

    # two TP ranks' worker stats + the scheduler's, aggregated as vLLM does (KVOutputAggregator, Scheduler)
    rank0, rank1, sched = ExpressLaneStats(), ExpressLaneStats(), ExpressLaneStats()
    for rank, s in ((0, rank0), (1, rank1)):
        s.inc("staging_copies")
        s.inc("sent_bytes", 1000)
        s.observe("send_seconds", 0.01 * (rank + 1))
        s.set_gauge("staging_slots_in_use", rank, 1)
    rank1.inc("send_failures", 1, "connect")
    sched.inc("claimed_requests")
    workers = MultiKVConnectorStats({"ExpressLaneConnector": rank0}).aggregate(
        MultiKVConnectorStats({"ExpressLaneConnector": rank1}))
    total = workers.aggregate(MultiKVConnectorStats({"ExpressLaneConnector": sched}))
    # the engine core -> API server hop (msgpack)
    # (vLLM 0.32's scheduler sends to_dict(); 0.26's sends .data, whose stats objects msgpack encodes by field)
    sent = total.to_dict() if hasattr(total, "to_dict") else total.data
    payload = msgspec.msgpack.decode(msgspec.msgpack.encode(sent))

    # LoggingStatLogger's path: MultiConnector rebuilds our stats by class name (we registered it)
    logging_ = KVConnectorLogging(vc.kv_transfer_config)
    logging_.observe(payload)
    lines = []
    logging_.log(log_fn=lambda fmt, s: lines.append(fmt % s))
    assert lines and "'claimed_requests': 1" in lines[0] and "'send_failures[connect]': 1" in lines[0]

    # PrometheusStatLogger's path
    prom.observe(payload, engine_idx=0)
    text = generate_latest(registry).decode()
    labels = 'engine="0",model_name="tiny"'
    for line in (f"expresslane_connector_claimed_requests_total{{{labels}}} 1.0",
                 f"expresslane_connector_staging_copies_total{{{labels}}} 2.0",
                 f"expresslane_connector_sent_bytes_total{{{labels}}} 2000.0",
                 f"expresslane_connector_send_seconds_count{{{labels}}} 2.0",
                 f'expresslane_connector_send_failures_total{{{labels},reason="connect"}} 1.0',
                 f'expresslane_connector_staging_slots_in_use{{{labels},rank="1"}} 1.0'):
        assert line in text, line
    for spec in METRICS:  # every name of the table is on /metrics
        assert re.search(rf"^# TYPE {spec.name}(_total)? {spec.prom_type}$", text, re.M), spec.name
        if spec.kind != "labelled":  # by-reason series appear with their first reason
            assert re.search(rf"^{spec.exposed_name}(_count)?{{", text, re.M), spec.exposed_name


def test_shipped_rid_keeps_vllm_stepping_until_every_rank_reports_it(model_dir) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.structured_output import StructuredOutputManager

    from expresslane.engine.connector.metadata import ExpressLaneWorkerMeta

    from .conftest import BLOCK, make_kv_cache_config, make_vllm_config

    vc = make_vllm_config(model_dir)
    sched = Scheduler(vc, make_kv_cache_config(), StructuredOutputManager(vc), block_size=BLOCK, log_stats=True)
    conn = sched.connector
    conn.connector_scheduler.world_size = 2  # as with TP 2
    sched.add_request(make_request("a", 40, marker("rid-a")))
    step(sched)
    step(sched)  # the step that tells the workers the request finished
    assert not sched.requests and not sched.finished_req_ids  # the request is done, its blocks free ...
    assert conn.has_pending_push_work() and sched.has_requests()  # ... but vLLM keeps stepping
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=ExpressLaneWorkerMeta({"rid-a": 1})))
    assert sched.has_requests()  # one rank of two
    both = ExpressLaneWorkerMeta({"rid-a": 1}).aggregate(ExpressLaneWorkerMeta({"rid-x": 1}))
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=both))
    assert not conn.has_pending_push_work() and not sched.has_requests()


def test_pending_work_is_bounded(model_dir) -> None:
    from expresslane.engine.connector.config import ExpressLaneConnectorConfig
    from expresslane.engine.connector.metadata import ExpressLaneConnectorMetadata
    from expresslane.engine.connector.scheduler import ExpressLaneScheduler, pending_bound_s

    now = [100.0]
    cfg = ExpressLaneConnectorConfig()
    s = ExpressLaneScheduler(cfg, 1024, clock=lambda: now[0])
    from .conftest import make_request as mk

    req = mk("a", 8, marker("rid-a"))
    s.on_new_request(req)

    class _So:  # the fields _scan reads, for one new request whose prompt completes in this step
        preempted_req_ids = ()
        scheduled_new_reqs = [type("N", (), {"req_id": "a", "block_ids": ([1],), "num_computed_tokens": 0})()]
        scheduled_cached_reqs = type("C", (), {"req_ids": []})()
        num_scheduled_tokens = {"a": 8}

    meta = s.build_connector_meta(_So())
    assert isinstance(meta, ExpressLaneConnectorMetadata) and len(meta.ship) == 1
    assert s.has_pending_push_work()
    now[0] += pending_bound_s(cfg) + 1  # no worker ever reported (a bug): the engine must not spin forever
    assert not s.has_pending_push_work()


def test_side_port_gets_the_same_numbers_when_configured() -> None:
    from expresslane.engine.connector.config import ExpressLaneConnectorConfig
    from expresslane.engine.connector.metrics import SidePortMetrics
    from expresslane.engine.connector.scheduler import ExpressLaneScheduler

    s = ExpressLaneScheduler(ExpressLaneConnectorConfig(metrics_port=9400), 1024)
    s.on_new_request(make_request("plain", 8))
    meta = s.build_connector_meta(type("So", (), {})())
    assert meta.stats_delta == {"unclaimed_requests": 1}  # to the rank-0 worker's side port
    assert s.get_stats().data == {"unclaimed_requests": 1}  # and, separately, to vLLM
    side = SidePortMetrics(staging_slots=2)
    side.observe(meta.stats_delta)
    assert side.value("expresslane_connector_unclaimed_requests_total") == 1
    assert side.value("expresslane_connector_staging_slots_free", {"rank": "0"}) == 2
    assert ExpressLaneScheduler(ExpressLaneConnectorConfig(), 1024).build_connector_meta(
        type("So", (), {})()).stats_delta == {}  # side port off: nothing extra travels


def test_built_twice_in_one_process_on_the_global_registry(model_dir) -> None:
    """vLLM re-creates its stat loggers (and unregisters its own vllm:* metrics first); ours must not raise
    'Duplicated timeseries' on the default registry either."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from .conftest import make_vllm_config

    vc = make_vllm_config(model_dir, connector=DEPLOYED)
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    try:
        from vllm.v1.metrics.prometheus import unregister_vllm_metrics

        for _ in range(2):
            unregister_vllm_metrics()  # what PrometheusStatLogger does first
            MultiConnector.build_prom_metrics(vc, types, ["model_name", "engine"], {0: ["m", "0"]})
        assert REGISTRY.get_sample_value("expresslane_connector_staging_slots_free",
                                         {"model_name": "m", "engine": "0", "rank": "0"}) == 3
    finally:
        from expresslane.engine.connector.stats import _unregister_ours

        _unregister_ours()
        unregister_vllm_metrics()


def test_idle_engine_is_paced_while_only_old_sends_are_pending(model_dir) -> None:
    """vLLM steps an engine with no requests every ~1 ms while push work is pending (two sends hung on a dead
    peer took the CPU stack's prefill from 0.97 to 1.63 cores). Young sends step at vLLM's rate; once the
    newest pending send is older than PACE_AFTER_S the hook sleeps PACE_S, once per engine step."""
    from expresslane.engine.connector.config import ExpressLaneConnectorConfig
    from expresslane.engine.connector.metadata import ExpressLaneWorkerMeta
    from expresslane.engine.connector.scheduler import PACE_AFTER_S, PACE_S, ExpressLaneScheduler

    from .conftest import make_request as mk

    now, slept = [100.0], []
    s = ExpressLaneScheduler(ExpressLaneConnectorConfig(), 1024, clock=lambda: now[0], sleep=slept.append)
    s.on_new_request(mk("a", 8, marker("rid-a")))

    class _So:
        preempted_req_ids = ()
        scheduled_new_reqs = [type("N", (), {"req_id": "a", "block_ids": ([1],), "num_computed_tokens": 0})()]
        scheduled_cached_reqs = type("C", (), {"req_ids": []})()
        num_scheduled_tokens = {"a": 8}

    class _Empty:  # an empty engine step
        preempted_req_ids = ()
        scheduled_new_reqs = []
        scheduled_cached_reqs = type("C", (), {"req_ids": []})()
        num_scheduled_tokens = {}

    assert len(s.build_connector_meta(_So()).ship) == 1
    assert s.has_pending_push_work() and s.has_pending_push_work() and slept == []  # young: vLLM's own rate
    now[0] += PACE_AFTER_S + 0.01
    assert s.has_pending_push_work() and slept == [PACE_S]  # old: one sleep for the step that ran
    assert s.has_pending_push_work() and s.has_pending_push_work() and slept == [PACE_S]  # no step since
    for _ in range(3):
        s.build_connector_meta(_Empty())
        assert s.has_pending_push_work() and s.has_pending_push_work()
    assert slept == [PACE_S] * 4  # one per step
    s.update_worker_meta(ExpressLaneWorkerMeta({"rid-a": 1}))
    s.build_connector_meta(_Empty())
    assert not s.has_pending_push_work() and slept == [PACE_S] * 4  # nothing pending: no pacing
