"""scripts/smoke.py runs on a bare Python (`python3 -S -I`: no site-packages at all) and judges what it sees.

The router here is a small stdlib HTTP server that answers like the real one (a fake of the upstream HTTP
server, the style of the router unit tests); the real stack is checked by .ci/compose-e2e.sh with the same script.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SMOKE = Path(__file__).resolve().parents[2] / "scripts" / "smoke.py"


def make_handler(express_text: str):
    """express_text: the express lane's answer; "crowd:" + text: the express lane answers `text` alone and
    something else while another express request is in flight (a node whose tokens depend on its neighbours)."""
    crowd = express_text.startswith("crowd:")
    express_text = express_text.removeprefix("crowd:")
    in_flight = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b'{"status":"ok"}')
            elif self.path == "/v1/models":
                data = [{"id": "tiny-llama", "lane": "native"}, {"id": "tiny-llama-express", "lane": "express"}]
                self._send(200, json.dumps({"data": data}).encode())
            elif self.path == "/metrics":
                self._send(200, b"# TYPE x counter\nx 1\n", "text/plain")
            else:
                self._send(404, b'{"error":"not found"}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = express_text if body["model"].endswith("-express") else "once upon a time"
            if crowd and body["model"].endswith("-express"):
                with lock:
                    in_flight[0] += 1
                time.sleep(0.3)  # long enough for users sent at once to meet
                with lock:
                    crowded = in_flight[0] > 1
                    in_flight[0] -= 1
                if crowded:
                    text = text + " (crowded)"
            chat = self.path == "/v1/chat/completions"
            if not body.get("stream"):
                choice = {"message": {"content": text}} if chat else {"text": text}
                self._send(200, json.dumps({"choices": [choice], "usage": {"completion_tokens": 4}}).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for word in text.split(" "):
                piece = word if word == text.split(" ")[0] else " " + word
                choice = {"delta": {"content": piece}} if chat else {"text": piece}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@pytest.fixture
def fake_router(request):
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(request.param))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run_bare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-S", "-I", str(SMOKE), *args], text=True, capture_output=True, timeout=60)


@pytest.mark.parametrize("fake_router", ["once upon a time"], indirect=True)
def test_bare_python_passes_against_a_router_that_answers_right(fake_router):
    proc = run_bare(fake_router, "--timeout", "10")
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0
    assert "14/14 passed" in proc.stdout


@pytest.mark.parametrize("fake_router,rows,shown", [
    ("once upon a tide", ["exact-chat", "exact-compl"], []),  # the lanes disagree
    ("crowd:once upon a time", ["users"], ["(crowded)", "alone"]),  # a node whose answers depend on its neighbours
], indirect=["fake_router"])
def test_a_router_that_answers_wrong_fails_exactly_those_rows(fake_router, rows, shown):
    proc = run_bare(fake_router, "--timeout", "10")
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 1
    failed = [line.split()[0] for line in proc.stdout.splitlines() if " FAIL " in line]
    assert failed == rows
    assert all(text in proc.stdout for text in shown)


def test_unreachable_router_is_a_table_of_failures_not_a_traceback():
    proc = run_bare("http://127.0.0.1:1", "--timeout", "2")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "Connection refused" in proc.stdout
