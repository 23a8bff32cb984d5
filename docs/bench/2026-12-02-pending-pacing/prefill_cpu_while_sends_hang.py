"""CPU of the prefill's processes idle vs while 2 KV sends hang on a black-hole peer (pending push work)."""
import os, sys, tempfile, time, uuid, json
from pathlib import Path
REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests"), str(REPO / "tests/integration")]
import httpx
from dev_stack import DevStack
from exactness import token_prompt
from fault_support import BlackHolePeer

TCK = os.sysconf("SC_CLK_TCK")
def tree(pid):
    out = [pid]
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except Exception:
                continue
            if ppid == pid:
                out += tree(int(p.name))
    return out
def cpu(pids):
    t = 0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            t += int(f[11]) + int(f[12])
        except Exception:
            pass
    return t / TCK
def sample(pids, s=10.0):
    c0, t0 = cpu(pids), time.monotonic(); time.sleep(s); return (cpu(pids) - c0) / (time.monotonic() - t0)

stack = DevStack(model_dir=REPO / "var/models/tiny-llama", state_dir=Path(tempfile.mkdtemp()) / "state", port_base=int(os.environ.get("PB", "23000")))
stack.start()
try:
    pids = tree(stack.pid("prefill"))
    print("prefill pids", pids, flush=True)
    print(json.dumps({"idle_cores": round(sample(pids), 3)}), flush=True)
    hole = BlackHolePeer()
    for i in range(2):
        r = httpx.post(f"{stack.prefill_url}/v1/completions", timeout=60, trust_env=False, json={
            "model": "tiny-llama", "prompt": token_prompt(100 + i, salt=21 + i), "max_tokens": 1,
            "kv_transfer_params": {"expresslane_host": "127.0.0.1", "expresslane_ctrl_port": hole.port,
                                   "expresslane_rid": uuid.uuid4().hex}})
        print("fill", r.status_code, flush=True)
    print(json.dumps({"hung_sends_cores": round(sample(pids), 3)}), flush=True)
    hole.close()
    time.sleep(3)
    print(json.dumps({"after_hole_closed_cores": round(sample(pids), 3)}), flush=True)
finally:
    stack.stop()
