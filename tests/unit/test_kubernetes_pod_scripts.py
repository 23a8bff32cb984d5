"""The pods' helper scripts (kubernetes/base/pod-scripts): the RDMA and allow-list start checks on a built sysfs/dev
tree, the preStop drain against a real HTTP server, the wait for the model's marker."""

from __future__ import annotations

import http.server
import json
import resource
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kubernetes" / "base" / "pod-scripts"))
import drain  # noqa: E402
import start_checks  # noqa: E402
import wait_model  # noqa: E402

UNLIMITED = resource.RLIM_INFINITY
GOOD = {"EXPRESSLANE_RDMA": "required", "UCX_TLS": "rc,sm,self,cuda_copy,cuda_ipc", "UCX_NET_DEVICES": "mlx5_0:1"}


@pytest.fixture
def node(tmp_path):
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    port = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (dev / "infiniband").mkdir(parents=True)
    (dev / "infiniband" / "uverbs0").write_text("")
    return sysfs, dev


def test_rdma_check_passes_on_an_active_port(node):
    assert "ACTIVE" in start_checks.check_rdma(GOOD, *node, UNLIMITED)


@pytest.mark.parametrize("change, says", [
    ({"UCX_TLS": "rc,sm,self,tcp"}, "fall back to TCP"),
    ({"UCX_TLS": "sm,self,cuda_ipc"}, "no RDMA transport"),
    ({"UCX_NET_DEVICES": "all"}, "name the RDMA ports"),
    ({"UCX_NET_DEVICES": "mlx5_1:1"}, "does not have"),
    ({"EXPRESSLANE_RDMA": ""}, "set it to `required`"),
])
def test_rdma_check_refuses_what_would_fall_back(node, change, says):
    with pytest.raises(start_checks.CheckFailed, match=says):
        start_checks.check_rdma({**GOOD, **change}, *node, UNLIMITED)


def test_rdma_check_refuses_a_down_port_no_uverbs_and_a_memlock_limit(node):
    sysfs, dev = node
    with pytest.raises(start_checks.CheckFailed, match="locked-memory limit"):
        start_checks.check_rdma(GOOD, sysfs, dev, 65536)
    (dev / "infiniband" / "uverbs0").unlink()
    with pytest.raises(start_checks.CheckFailed, match="uverbs"):
        start_checks.check_rdma(GOOD, sysfs, dev, UNLIMITED)
    (sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "state").write_text("1: DOWN\n")
    with pytest.raises(start_checks.CheckFailed, match="not ACTIVE"):
        start_checks.check_rdma(GOOD, sysfs, dev, UNLIMITED)


def test_the_opt_out_is_explicit_and_says_so(node):
    assert "off on purpose" in start_checks.check_rdma({"EXPRESSLANE_RDMA": "off"}, *node, 0)


def test_allow_list_must_cover_the_pod_address():
    env = {"EXPRESSLANE_ALLOWED_DESTINATIONS": "10.244.0.0/16:5556", "POD_IP": "10.244.3.7"}
    assert "inside" in start_checks.check_allow_list(env)
    with pytest.raises(start_checks.CheckFailed, match="outside every network"):
        start_checks.check_allow_list({**env, "POD_IP": "192.168.1.9"})
    assert "exact" in start_checks.check_allow_list({"EXPRESSLANE_ALLOWED_DESTINATIONS": "10.0.0.3:5556"})


def test_main_exits_1_with_one_line_and_execs_on_success(node, capsys, monkeypatch):
    sysfs, dev = node
    monkeypatch.setenv("EXPRESSLANE_RDMA", "required")
    monkeypatch.setenv("UCX_TLS", "tcp")
    assert start_checks.main(["--sysfs-root", str(sysfs), "--dev-root", str(dev), "--", "true"]) == 1
    assert "start check failed" in capsys.readouterr().err
    ran = []
    monkeypatch.setattr(start_checks.os, "execvp", lambda f, a: ran.append(a))
    monkeypatch.setenv("EXPRESSLANE_RDMA", "off")
    start_checks.main(["--", "bash", "x.sh"])
    assert ran == [["bash", "x.sh"]]


class _Status(http.server.BaseHTTPRequestHandler):
    answers: list[str] = []

    def do_GET(self):  # noqa: N802
        body = (self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def test_drain_waits_until_the_node_is_idle(server):
    _Status.answers = [json.dumps({"state": "busy"}), json.dumps({"state": "busy"}), json.dumps({"state": "idle"})]
    url = f"http://127.0.0.1:{server.server_port}/decode_status"
    lines = []
    assert drain.drain(lambda: drain.decode_idle(drain.fetch(url, "t")), 0, 30, log=lines.append) == "idle"
    assert _Status.answers == [json.dumps({"state": "idle"})]  # it polled through both busy answers


def test_drain_reads_vllms_metrics_and_gives_up_at_the_deadline(server):
    _Status.answers = ['vllm:num_requests_running{model_name="m"} 1.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n']
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    assert drain.vllm_in_flight(drain.fetch(url, None)) == 1.0
    assert drain.drain(lambda: drain.vllm_in_flight(drain.fetch(url, None)) == 0, 0, 0.5, log=print) == "deadline"
    assert drain.decode_idle(json.dumps({"status": "idle", "current_rid": None}))  # TileRT's shape


def test_drain_stops_when_the_server_is_gone():
    assert drain.drain(lambda: drain.decode_idle(drain.fetch("http://127.0.0.1:9/x", None)), 0, 30,
                       log=print) == "gone"


def test_wait_model_waits_for_the_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("MODEL_DIR", str(tmp_path / "m"))
    assert wait_model.main(["--timeout", "0.2", "--poll", "0.05"]) == 1
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / ".expresslane-ready").write_text("abc\n")
    assert wait_model.main(["--timeout", "1", "--poll", "0.05"]) == 0
