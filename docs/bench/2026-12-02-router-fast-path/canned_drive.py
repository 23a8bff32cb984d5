"""Options (env): BURN=N: N busy-looping processes beside it (the real stack's
vLLM workers keep both cores busy), DELAY_S=seconds (env): each canned upstream reply waits that long (a model's
time, so each of the router's wake-ups finds cold caches), and SPY=OUT.txt (env): py-spy (SPY_BIN, default py-spy on PATH)
samples the router's threads over the N measured requests, raw collapsed stacks into OUT.txt.

Profiling harness (not the bench): two canned vLLM-shaped upstreams (profile_fake_upstream.py) and the router from
TREE (its router/src on PYTHONPATH), N sequential non-streaming native-lane requests back to back; prints the
router's CPU ms per request. With PROF, the router runs under cProfile (CPU-time timer, profile_run.py).

    python canned_drive.py TREE N [PROF]
"""
import os, subprocess, sys, time, random, json, tempfile
from pathlib import Path
HERE = Path(__file__).resolve().parent  # IDLE_S=seconds of the idle window (env)
TMP = Path(tempfile.mkdtemp())
import httpx, psutil
IDLE_S = float(os.environ.get("IDLE_S", "2"))
REPO = sys.argv[1]; N = int(sys.argv[2]); prof = sys.argv[3] if len(sys.argv) > 3 else None
_o = int(os.environ.get("PORT_OFFSET", "0"))  # run two at once
up_port, up2_port, rport = 41001 + _o, 41002 + _o, 41010 + _o
sys.path.insert(0, str(HERE.parents[2] / "scripts"))
from bench_lib.servers import Endpoints, bench_router_yaml  # the bench's own router config (scripts/bench.py)
_ep = Endpoints(router="", prefill=f"http://127.0.0.1:{up_port}", native=f"http://127.0.0.1:{up2_port}",
                express=f"http://127.0.0.1:{up2_port}", connector_metrics=None, express_ctrl_host="127.0.0.1",
                express_ctrl_port=41003 + _o, model_dir=HERE.parents[2] / "var" / "models" / "tiny-llama")
cfg = bench_router_yaml(_ep, rport, 4096)
if os.environ.get("HEALTH_OFF"):
    cfg += "health: {enabled: false}\n"
(TMP / "router.yaml").write_text(cfg)
env = dict(os.environ, PYTHONPATH=f"{REPO}/engine/src:{REPO}/router/src")
py = sys.executable
burners = [subprocess.Popen([py, "-c", "while True: pass"]) for _ in range(int(os.environ.get("BURN", "0")))]
ups = [subprocess.Popen([py, str(HERE / "profile_fake_upstream.py"), str(p)]) for p in (up_port, up2_port)]
cmd = [py] + ([str(HERE / "profile_run.py"), prof] if prof else ["-m", "expresslane.router"]) + [ "--config", str(TMP / "router.yaml"), "--log-level", "warning"]
if os.environ.get("ROUTER_NICE"):  # ROUTER_NICE=N (env): the router runs under `nice -n N`
    cmd = ["nice", "-n", os.environ["ROUTER_NICE"]] + cmd
r = subprocess.Popen(cmd, env=env, stdout=open(TMP / "router.log", "wb"), stderr=subprocess.STDOUT)
try:
    for _ in range(200):
        try:
            if httpx.get(f"http://127.0.0.1:{rport}/health", trust_env=False).status_code == 200: break
        except httpx.HTTPError: pass
        time.sleep(0.1)
    time.sleep(1.5)
    p = psutil.Process(r.pid)
    rnd = random.Random(0)
    with httpx.Client(trust_env=False, timeout=30) as c:
        def one(i):
            body = {"model": "bench-native", "prompt": [rnd.randrange(1000) for _ in range(128)], "max_tokens": 1,
                    "temperature": 0.0, "ignore_eos": True}
            resp = c.post(f"http://127.0.0.1:{rport}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
        for i in range(20): one(i)
        idle0 = p.cpu_times(); time.sleep(IDLE_S); idle1 = p.cpu_times()
        idle_ms_s = 1e3 * ((idle1.user + idle1.system) - (idle0.user + idle0.system)) / IDLE_S
        spy = None
        if os.environ.get("SPY"):
            spy = subprocess.Popen([os.environ.get("SPY_BIN", "py-spy"), "record", "--pid", str(r.pid),
                                    "--rate", "500", "--nonblocking", "--format", "raw", "-o", os.environ["SPY"]],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        if os.environ.get("PERF"):  # PERF=OUT.data: perf record -g on the router over the measured requests
            spy = subprocess.Popen(["perf", "record", "-g", "-F", "2000", "-p", str(r.pid), "-o", os.environ["PERF"]],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        if os.environ.get("STRACE"):  # STRACE=OUT.txt: strace -c -f on the router over the measured requests
            spy = subprocess.Popen(["strace", "-c", "-f", "-p", str(r.pid), "-o", os.environ["STRACE"]],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        t0 = p.cpu_times(); w0 = time.perf_counter(); x0 = p.num_ctx_switches()
        for i in range(N): one(i)
        t1 = p.cpu_times(); w1 = time.perf_counter(); x1 = p.num_ctx_switches()
        if spy is not None:
            import signal as _s2; spy.send_signal(_s2.SIGINT); spy.wait(30)
    if prof:
        import signal as _s; r.send_signal(_s.SIGUSR1); time.sleep(2)
    cpu = (t1.user + t1.system) - (t0.user + t0.system)
    print(json.dumps({"cpu_ms_per_req": round(1e3 * cpu / N, 3), "wall_ms_per_req": round(1e3 * (w1 - w0) / N, 3),
                      "idle_cpu_ms_per_s": round(idle_ms_s, 3),
                      "user_ms_per_req": round(1e3 * (t1.user - t0.user) / N, 3),
                      "sys_ms_per_req": round(1e3 * (t1.system - t0.system) / N, 3),
                      "voluntary_switches_per_req": round((x1.voluntary - x0.voluntary) / N, 2),
                      "involuntary_switches_per_req": round((x1.involuntary - x0.involuntary) / N, 2)}))
finally:
    r.terminate(); r.wait(20)
    for u in ups + burners: u.terminate(); u.wait()
