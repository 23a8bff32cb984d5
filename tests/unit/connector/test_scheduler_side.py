"""Scheduler-side connector logic, driven by vLLM's real Scheduler (and real SchedulerOutput objects)."""

from __future__ import annotations

import pytest

from .conftest import make_request, marker, step

pytest.importorskip("vllm")


def _ours(sched):
    from expresslane.engine.connector import ExpressLaneConnector

    assert isinstance(sched.connector, ExpressLaneConnector)
    return sched.connector


def _run(sched, max_steps: int = 20):
    metas = []
    for _ in range(max_steps):
        if not sched.requests:
            break
        metas.append(step(sched).kv_connector_metadata)
    assert not sched.requests, "requests did not finish"
    return metas


def test_unclaimed_requests_are_a_strict_noop(scheduler) -> None:
    conn = _ours(scheduler)
    scheduler.add_request(make_request("plain", 40))
    scheduler.add_request(make_request("tilert", 40, {"tilert_host": "10.0.0.1", "tilert_ctrl_port": 5556}))
    scheduler.add_request(make_request("native", 40, {"do_remote_decode": True}))
    metas = _run(scheduler)
    assert all(m.ship == [] for m in metas)
    sched_side = conn.connector_scheduler
    assert sched_side.totals == {"unclaimed_requests": 3}
    assert sched_side._tracked == {}
    # Nothing reaches the worker (the side port is off); the count goes to vLLM's stats once.
    assert all(m.is_empty() for m in metas)
    # through vLLM's scheduler into SchedulerStats (what the API server's Prometheus logger observes)
    assert scheduler.connector_stats == [{"unclaimed_requests": 3}]
    assert not conn.has_pending_push_work()


def test_claimed_ships_once_with_all_blocks_and_never_holds_blocks(scheduler) -> None:
    conn = _ours(scheduler)
    scheduler.add_request(make_request("a", 40, marker("rid-a")))
    metas = _run(scheduler)
    ships = [s for m in metas for s in m.ship]
    assert len(ships) == 1
    ship = ships[0]
    assert (ship.req_id, ship.claim.rid, ship.claim.port, ship.num_tokens) == ("a", "rid-a", 5556, 40)
    assert len(ship.block_ids) == 1 and len(ship.block_ids[0]) == 3  # ceil(40 / 16)
    assert conn.connector_scheduler.totals == {"claimed_requests": 1}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 100 - 1  # all freed (1 null block)


def test_chunked_prefill_ships_once_at_completion(scheduler) -> None:
    """100-token prompt, 64-token budget: chunk 1 ships nothing, chunk 2 ships all 7 blocks, once."""
    scheduler.add_request(make_request("long", 100, marker("rid-long")))
    so1 = step(scheduler)
    assert so1.num_scheduled_tokens == {"long": 64} and so1.kv_connector_metadata.ship == []
    so2 = step(scheduler)
    assert so2.num_scheduled_tokens == {"long": 36}
    (ship,) = so2.kv_connector_metadata.ship
    assert ship.num_tokens == 100
    all_blocks = so1.scheduled_new_reqs[0].block_ids[0] + (so2.scheduled_cached_reqs.new_block_ids[0] or ([],))[0]
    assert ship.block_ids[0][:7] == all_blocks[:7] and len(ship.block_ids[0]) == 7
    metas = _run(scheduler)
    assert all(m.ship == [] for m in metas)


def test_abort_before_completion_drops_and_counts(scheduler) -> None:
    from vllm.v1.request import RequestStatus

    conn = _ours(scheduler)
    scheduler.add_request(make_request("ab", 100, marker("rid-ab")))
    step(scheduler)  # first chunk only
    scheduler.finish_requests("ab", RequestStatus.FINISHED_ABORTED)
    metas = [step(scheduler).kv_connector_metadata]  # the next step carries the counter to the worker
    assert all(m.ship == [] for m in metas)
    assert conn.connector_scheduler.totals == {"claimed_requests": 1, "send_failures:finished_before_ship": 1,
                                               "send_aborts:finished_before_ship": 1}
    assert scheduler.connector_stats == [{"claimed_requests": 1}, {"send_failures": {"finished_before_ship": 1},
                                                                   "send_aborts": {"finished_before_ship": 1}}]


def test_malformed_marker_is_not_claimed_and_counted(scheduler) -> None:
    conn = _ours(scheduler)
    scheduler.add_request(make_request("bad", 8, {"expresslane_host": "h", "expresslane_rid": "r"}))
    metas = _run(scheduler)
    assert all(m.ship == [] for m in metas)
    assert conn.connector_scheduler.totals == {"send_failures:bad_params": 1}


def test_mixed_batch_ships_only_the_claimed_one(scheduler) -> None:
    scheduler.add_request(make_request("u1", 30))
    scheduler.add_request(make_request("c1", 20, marker("rid-c1")))
    scheduler.add_request(make_request("u2", 10, {"do_remote_decode": True}))
    ships = [s for m in _run(scheduler) for s in m.ship]
    assert [(s.req_id, s.claim.rid, s.num_tokens) for s in ships] == [("c1", "rid-c1", 20)]


def test_preemption_and_resume_ship_the_resumed_blocks() -> None:
    """Preempted mid-prompt: the blocks it had are freed; it ships the block list it resumed with."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from expresslane.engine.connector.scheduler import ExpressLaneScheduler

    sched = ExpressLaneScheduler()
    req = make_request("p", 100, marker("rid-p"))
    sched.on_new_request(req)

    def output(new=(), cached=None, scheduled=None, preempted=None):
        so = SchedulerOutput.make_empty()
        so.scheduled_new_reqs = list(new)
        if cached is not None:
            so.scheduled_cached_reqs = cached
        so.num_scheduled_tokens = scheduled or {}
        so.preempted_req_ids = preempted
        return so

    def cached(block_ids, computed, resumed):
        return CachedRequestData(req_ids=["p"], resumed_req_ids={"p"} if resumed else set(), new_token_ids=[[]],
                                 all_token_ids={}, new_block_ids=[block_ids], num_computed_tokens=[computed],
                                 num_output_tokens=[0])

    new = NewRequestData.from_request(req, ([1, 2, 3, 4],))
    assert sched.build_connector_meta(output([new], scheduled={"p": 64})).ship == []
    assert sched.build_connector_meta(output(preempted={"p"})).ship == []
    # Resumed from scratch with a complete new block list, chunked again.
    assert sched.build_connector_meta(output(cached=cached(([9, 10, 11, 12],), 0, True),
                                             scheduled={"p": 64})).ship == []
    (ship,) = sched.build_connector_meta(output(cached=cached(([13, 14, 15],), 64, False),
                                                scheduled={"p": 36})).ship
    assert ship.block_ids == ([9, 10, 11, 12, 13, 14, 15],) and ship.num_tokens == 100
    # Never twice, and finishing afterwards is not a failure.
    assert sched.build_connector_meta(output(cached=cached(None, 100, False), scheduled={"p": 1})).ship == []
    assert sched.request_finished(req) == (False, {"expresslane_rid": "rid-p", "expresslane_status": "staged",
                                                   "expresslane_error": ""})
    assert sched.totals == {"claimed_requests": 1}


def test_producer_contract_and_hma(model_dir) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA, supports_hma
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from expresslane.engine.connector import ExpressLaneConnector

    from .conftest import make_kv_cache_config, make_vllm_config

    assert supports_hma(ExpressLaneConnector) and issubclass(ExpressLaneConnector, SupportsHMA)
    vc = make_vllm_config(model_dir)
    conn = ExpressLaneConnector(vc, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    req = make_request("x", 10, marker())
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert conn.requires_kv_delivery is False
    conn.on_new_request(req)
    # unshipped -> dropped, never held; the outcome rides in kv_transfer_params
    assert conn.request_finished_all_groups(req, ([1],)) == (False, {
        "expresslane_rid": "rid-1", "expresslane_status": "failed", "expresslane_error": "finished_before_ship"})
    # As deployed (scripts/launch/prefill.sh): every MultiConnector child supports HMA, so vLLM keeps the
    # hybrid KV cache manager on and the NixlConnector compatibility hash matches plain NIXL decoders.
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_producer", kv_connector_extra_config={
        "connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"},
            {"kv_connector": "ExpressLaneConnector", "kv_connector_module_path": "expresslane.engine.connector",
             "kv_role": "kv_producer", "kv_connector_extra_config": {"metrics_port": 9400}},
        ]})
    assert MultiConnector.all_children_support_hma(multi)


def test_config_is_strict(model_dir) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from expresslane.engine.connector import ExpressLaneConnector

    from .conftest import make_kv_cache_config, make_vllm_config

    vc = make_vllm_config(model_dir, connector={
        "kv_connector": "ExpressLaneConnector", "kv_connector_module_path": "expresslane.engine.connector",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"metrics_prot": 9400}})
    with pytest.raises(ValueError, match="metrics_prot"):
        ExpressLaneConnector(vc, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    vc = make_vllm_config(model_dir, connector={
        "kv_connector": "ExpressLaneConnector", "kv_connector_module_path": "expresslane.engine.connector",
        "kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="kv_producer"):
        ExpressLaneConnector(vc, KVConnectorRole.SCHEDULER, make_kv_cache_config())


def test_outcome_reaches_the_engine_output_for_every_claim(scheduler) -> None:
    """What vLLM's real scheduler puts in each finished request's output (the prefill's HTTP response)."""
    from vllm.v1.request import RequestStatus

    scheduler.add_request(make_request("ok", 20, marker("rid-ok")))
    scheduler.add_request(make_request("plain", 20))
    scheduler.add_request(make_request("bad", 8, {"expresslane_host": "h", "expresslane_rid": "rid-bad"}))
    scheduler.add_request(make_request("ab", 100, marker("rid-ab")))
    step(scheduler)
    scheduler.finish_requests("ab", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("next", 4))
    metas = _run(scheduler)
    got = scheduler.finished_kv_params
    assert got["ok"] == {"expresslane_rid": "rid-ok", "expresslane_status": "staged", "expresslane_error": ""}
    assert got["plain"] is None
    assert got["bad"] == {"expresslane_rid": "rid-bad", "expresslane_status": "failed", "expresslane_error": "bad_params"}
    # an aborted request: the abort goes to the node too (through the worker), so its waiter fails at once
    assert [(a.claim.rid, a.reason) for m in metas for a in m.abort] == [("rid-ab", "finished_before_ship")]


def test_no_free_staging_slot_fails_in_the_prefills_reply(scheduler) -> None:
    """With every staging slot held by a send in flight (staging_slots = 2, no worker has reported one done),
    the next claimed request is not shipped: its own reply says failed (no_staging_slot), so the router answers
    its client without waiting on the node, and the node gets the abort. Once a worker reports a send done, the
    next claim ships again."""
    from expresslane.engine.connector.metadata import ExpressLaneWorkerMeta

    ours = _ours(scheduler).connector_scheduler
    assert ours.config.staging_slots == 2
    try:
        for i in range(3):
            scheduler.add_request(make_request(f"r{i}", 20, marker(f"rid-{i}")))
        metas = _run(scheduler)
        assert [s.claim.rid for m in metas for s in m.ship] == ["rid-0", "rid-1"]
        got = scheduler.finished_kv_params
        assert [got[f"r{i}"]["expresslane_status"] for i in range(3)] == ["staged", "staged", "failed"]
        assert got["r2"]["expresslane_error"] == "no_staging_slot"
        assert [(a.claim.rid, a.reason) for m in metas for a in m.abort] == [("rid-2", "no_staging_slot")]
        assert ours.totals["send_failures:no_staging_slot"] == 1
        ours.update_worker_meta(ExpressLaneWorkerMeta({"rid-0": 1}))  # its send is done: the slot is free
        scheduler.add_request(make_request("r3", 20, marker("rid-3")))
        assert [s.claim.rid for m in _run(scheduler) for s in m.ship] == ["rid-3"]
        assert scheduler.finished_kv_params["r3"]["expresslane_status"] == "staged"
    finally:
        ours.shutdown()


def test_the_slot_count_waits_for_every_rank_and_forgets_a_lost_report_under_load() -> None:
    """TP 2: a send holds a slot on each rank until both report it done. A report that never comes is forgotten
    after pending_bound_s when the next claim is admitted, without the push-work hook (vLLM asks that only while
    the engine has no requests), so a lost report cannot refuse every claim for as long as the engine is busy."""
    from types import SimpleNamespace

    from expresslane.engine.connector.config import ExpressLaneConnectorConfig
    from expresslane.engine.connector.metadata import ExpressLaneConnectorMetadata, ExpressLaneWorkerMeta
    from expresslane.engine.connector.scheduler import ExpressLaneScheduler, pending_bound_s

    now = [100.0]
    sched = ExpressLaneScheduler(ExpressLaneConnectorConfig(), world_size=2, clock=lambda: now[0])

    def claim(i: int) -> str:
        """Admit request i, its prompt computed in this step: 'staged', or the reason it failed."""
        sched.on_new_request(make_request(f"r{i}", 20, marker(f"rid-{i}")))
        tracked = sched._tracked[f"r{i}"]
        tracked.block_ids = [[0, 1]]
        meta = ExpressLaneConnectorMetadata()
        sched._maybe_ship(f"r{i}", tracked, 20, SimpleNamespace(num_scheduled_tokens={}), meta)
        out = sched.request_finished(make_request(f"r{i}", 20))[1]
        assert (out["expresslane_status"] == "staged") == bool(meta.ship)
        return out["expresslane_status"] if meta.ship else out["expresslane_error"]

    try:
        assert [claim(0), claim(1), claim(2)] == ["staged", "staged", "no_staging_slot"]
        sched.update_worker_meta(ExpressLaneWorkerMeta({"rid-0": 1}))  # one rank of two: still held
        assert claim(3) == "no_staging_slot"
        sched.update_worker_meta(ExpressLaneWorkerMeta({"rid-0": 1}))  # both ranks: free
        assert claim(4) == "staged"
        now[0] += pending_bound_s(sched.config) + 1  # rid-1's and rid-4's reports are lost
        assert claim(5) == "staged" and list(sched._pending) == ["rid-5"]
    finally:
        sched.shutdown()


def test_allow_list_and_too_long_are_decided_before_anything_is_sent(model_dir, monkeypatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from .conftest import BLOCK, make_kv_cache_config, make_vllm_config

    monkeypatch.setenv("EXPRESSLANE_ALLOWED_DESTINATIONS", "127.0.0.1:5556, node-b:7000")
    vc = make_vllm_config(model_dir, connector={
        "kv_connector": "ExpressLaneConnector", "kv_connector_module_path": "expresslane.engine.connector",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"staging_max_tokens": 50}})
    sched = Scheduler(vc, make_kv_cache_config(), StructuredOutputManager(vc), block_size=BLOCK)
    ours = _ours(sched).connector_scheduler
    assert ours.config.expresslane_allowed_destinations == {("127.0.0.1", 5556), ("node-b", 7000)}
    sched.add_request(make_request("evil", 20, {"expresslane_host": "169.254.169.254", "expresslane_ctrl_port": 80,
                                                "expresslane_rid": "rid-evil"}))
    sched.add_request(make_request("long", 60, marker("rid-long")))
    sched.add_request(make_request("fine", 20, marker("rid-fine")))
    metas = _run(sched)
    sched.add_request(make_request("next", 4))
    metas += _run(sched)
    assert [s.claim.rid for m in metas for s in m.ship] == ["rid-fine"]
    # not allowed: never shipped and no abort either (nothing is ever sent to that address)
    assert [(a.claim.rid, a.reason) for m in metas for a in m.abort] == [("rid-long", "too_long")]
    got = sched.finished_kv_params
    assert got["evil"] == {"expresslane_rid": "rid-evil", "expresslane_status": "failed",
                           "expresslane_error": "not_allowed"}
    assert got["long"]["expresslane_error"] == "too_long" and got["fine"]["expresslane_status"] == "staged"
    assert ours.totals["refused_destinations"] == 1 and ours.totals["send_failures:not_allowed"] == 1


def test_a_cidr_allow_list_ships_to_a_pod_address_and_refuses_names_and_other_ports(model_dir, monkeypatch) -> None:
    """The Kubernetes base's allow-list (the pod CIDR on the control port), through the real scheduler: the
    router names an express pod by its address, which ships; a name or another port is refused, never contacted."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from .conftest import BLOCK, make_kv_cache_config, make_vllm_config

    monkeypatch.setenv("EXPRESSLANE_ALLOWED_DESTINATIONS", "10.244.0.0/16:5556")
    vc = make_vllm_config(model_dir, connector={
        "kv_connector": "ExpressLaneConnector", "kv_connector_module_path": "expresslane.engine.connector",
        "kv_role": "kv_producer"})
    sched = Scheduler(vc, make_kv_cache_config(), StructuredOutputManager(vc), block_size=BLOCK)
    for rid, host, port in (("pod", "10.244.3.17", 5556), ("name", "decode-express-0.decode-express", 5556),
                            ("port", "10.244.3.17", 5557), ("outside", "10.96.0.1", 5556)):
        sched.add_request(make_request(rid, 20, {"expresslane_host": host, "expresslane_ctrl_port": port,
                                                 "expresslane_rid": f"rid-{rid}"}))
    metas = _run(sched)
    assert [s.claim.rid for m in metas for s in m.ship] == ["rid-pod"]
    assert [a.claim.rid for m in metas for a in m.abort] == []  # nothing is ever sent to a refused address
    got = sched.finished_kv_params
    assert {rid: got[rid].get("expresslane_error") for rid in ("name", "port", "outside")} == dict.fromkeys(
        ("name", "port", "outside"), "not_allowed")
    assert _ours(sched).connector_scheduler.totals["refused_destinations"] == 3


def test_allow_list_parsing_is_strict() -> None:
    from expresslane.engine.connector.config import ExpressLaneConnectorConfig, parse_destinations

    assert parse_destinations("a:1,[::1]:2, ") == {("a", 1), ("::1", 2)}
    for bad in ("a", "a:0", "a:x", ":5"):
        with pytest.raises(ValueError, match="host:port"):
            parse_destinations(bad)
    cfg = ExpressLaneConnectorConfig.from_extra_config({"expresslane_allowed_destinations": ["n:1"]},
                                                       env={"EXPRESSLANE_PEER_SECRET": "s"})
    assert cfg.allows("n", 1) and not cfg.allows("n", 2) and cfg.peer_secret == b"s"
    assert "peer_secret" not in repr(cfg)  # the secret never reaches a log line
    assert ExpressLaneConnectorConfig.from_extra_config({}).allows("anything", 1)  # empty = open (warned)


def test_allow_list_takes_networks_for_pod_addresses() -> None:
    """A pod-network express node gets a new address on every restart: a CIDR:port entry allows any IP inside
    it on that port; a hostname never matches a network (the connector does no DNS lookup)."""
    import ipaddress

    from expresslane.engine.connector.config import BadDestination, ExpressLaneConnectorConfig, parse_destinations

    got = parse_destinations("10.244.0.0/16:5556, [fd00::/64]:5556, node-a:7000")
    assert got == {(ipaddress.ip_network("10.244.0.0/16"), 5556), (ipaddress.ip_network("fd00::/64"), 5556),
                   ("node-a", 7000)}
    cfg = ExpressLaneConnectorConfig.from_extra_config(
        {}, env={"EXPRESSLANE_ALLOWED_DESTINATIONS": "10.244.0.0/16:5556,[fd00::/64]:5556,node-a:7000"})
    assert cfg.allows("10.244.3.17", 5556) and cfg.allows("10.244.255.255", 5556)
    assert cfg.allows("fd00::5", 5556) and cfg.allows("[fd00::5]", 5556)
    assert cfg.allows("node-a", 7000)  # exact entries still work beside networks
    assert not cfg.allows("10.244.3.17", 5557)  # the port is part of the entry
    assert not cfg.allows("10.245.0.1", 5556) and not cfg.allows("fd01::1", 5556)  # outside the network
    assert not cfg.allows("decode-express-0.decode-express", 5556)  # a hostname never matches a network
    assert not cfg.allows("169.254.169.254", 80) and not cfg.allows("not an address", 5556)
    for bad, why in (("10.244.0.1/16:5556", "host bits set"), ("10.244.0.0/33:5556", "does not appear to be"),
                     ("[fd00::/129]:5556", "does not appear to be"), ("10.244.0.0/16", "CIDR:port"),
                     ("node/16:5556", "does not appear to be")):
        with pytest.raises(BadDestination, match=why) as err:
            parse_destinations(bad)
        assert repr(bad) in str(err.value)  # the error names the entry


def test_scheduler_found_failure_reaches_the_waiting_node_at_once() -> None:
    """too_long is found in the scheduler process: its TCP-only abort sender tells the node right away."""
    import asyncio
    import socket
    import time

    import torch

    pytest.importorskip("nixl")
    from expresslane.engine.connector.config import ExpressLaneConnectorConfig
    from expresslane.engine.connector.scheduler import ExpressLaneScheduler
    from expresslane.engine.transfer import KVReceiver, KVTransferFailed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rx = KVReceiver(2, 4, 8, torch.float32, "cpu", 64, "127.0.0.1", ctrl_port=port, num_slots=1)
    rx.start()
    sched = ExpressLaneScheduler(ExpressLaneConnectorConfig(), max_tokens=10)
    try:
        rx.expect("rid-long", 30)

        async def wait() -> float:
            waiter = asyncio.create_task(rx.wait_for("rid-long", 30))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            sched.on_new_request(make_request("long", 20, marker("rid-long", port=port)))
            with pytest.raises(KVTransferFailed) as e:
                await waiter
            assert e.value.reason == "aborted:too_long"
            return time.monotonic() - t0

        assert asyncio.run(wait()) < 5
        assert sched.request_finished(make_request("long", 20))[1]["expresslane_error"] == "too_long"
    finally:
        sched.shutdown()
        rx.stop()
