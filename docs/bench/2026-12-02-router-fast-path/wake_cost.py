"""How much CPU does a wake-up cost after an idle gap? A uvloop TCP server answering one line per request, doing
WORK iterations of json work per request; a client sending a request every GAP seconds; server CPU per request."""
import asyncio, json, os, socket, sys, time, subprocess
mode = sys.argv[1]
if mode == "server":
    import uvloop
    work = int(sys.argv[2])
    body = json.dumps({"model": "m", "prompt": list(range(128)), "max_tokens": 1})
    class P(asyncio.Protocol):
        def connection_made(self, t): self.t = t
        def data_received(self, d):
            for _ in range(work):
                json.dumps(json.loads(body))
            self.t.write(b"ok\n")
    async def main():
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(P, "127.0.0.1", 47111)
        await asyncio.sleep(3600)
    uvloop.install(); asyncio.run(main())
else:
    work, gap, n = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    p = subprocess.Popen([sys.executable, __file__, "server", str(work)])
    time.sleep(1.0)
    s = socket.create_connection(("127.0.0.1", 47111))
    def cpu():
        f = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    def ns():
        t = 0
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            t += int(open(f"/proc/{p.pid}/task/{tid}/schedstat").read().split()[0])
        return t
    for _ in range(20): s.sendall(b"x\n"); s.recv(10)
    per = []
    for _ in range(n):
        time.sleep(gap)
        a = ns(); s.sendall(b"x\n"); s.recv(10); b = ns()
        per.append((b - a) / 1e3)
    per.sort()
    print(f"work={work} gap={gap}: server CPU per request p50 {per[len(per)//2]:.0f} us, p10 {per[len(per)//10]:.0f}, p90 {per[9*len(per)//10]:.0f}")
    p.kill()
