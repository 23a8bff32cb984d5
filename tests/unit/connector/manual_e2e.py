"""Manual end-to-end check of the express-lane connector against a live prefill (not collected by pytest).

    MODEL_DIR=var/models/tiny-llama PYTHON=.venv/bin/python PREFILL_PORT=18700 PREFILL_NIXL_PORT=15700 \
        CONNECTOR_METRICS_PORT=19700 BIND_HOST=127.0.0.1 bash scripts/launch/prefill.sh &
    .venv/bin/python tests/unit/connector/manual_e2e.py --model-dir var/models/tiny-llama --prefill http://127.0.0.1:18700 \
        --metrics http://127.0.0.1:19700/metrics --ctrl-port 15756

Runs a KVReceiver here, sends express requests (short, and longer than --max-num-batched-tokens so the
prompt is chunked), checks the dense K/V that arrived against transformers' past_key_values (float32),
then checks that unmarked and native ({"do_remote_decode": true}) requests move no connector counter but
``unclaimed``. Exit code 0 when everything holds.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys

import httpx
import torch


def counters(http: httpx.Client, url: str) -> dict[str, float]:
    out = {}
    for line in http.get(url).text.splitlines():
        m = re.match(r"^(expresslane_connector_\w+_total)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def reference_kv(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        pkv = model(torch.tensor([ids]), use_cache=True).past_key_values
    ks, vs = [], []
    for i in range(model.config.num_hidden_layers):
        k, v = (pkv.layers[i].keys, pkv.layers[i].values) if hasattr(pkv, "layers") else pkv[i]
        ks.append(k[0].transpose(0, 1))
        vs.append(v[0].transpose(0, 1))
    return torch.stack(ks), torch.stack(vs)


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--ctrl-port", type=int, default=15756)
    ap.add_argument("--lengths", default="40,1300")
    args = ap.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from expresslane.engine.transfer import KVReceiver

    cfg = AutoConfig.from_pretrained(args.model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    rx = KVReceiver(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, torch.float32, "cpu", 4096,
                    "127.0.0.1", ctrl_port=args.ctrl_port)
    rx.start()
    ok = True
    http = httpx.Client(timeout=300)
    try:
        for n in map(int, args.lengths.split(",")):
            rid = f"manual-{n}"
            ids = [(i * 37 + 11) % 1000 + 10 for i in range(n)]
            body = {"model": "tiny-llama", "prompt": ids, "max_tokens": 1, "kv_transfer_params": {
                "expresslane_host": "127.0.0.1", "expresslane_ctrl_port": args.ctrl_port, "expresslane_rid": rid}}
            http.post(args.prefill + "/v1/completions", json=body).raise_for_status()
            got = await rx.wait_for(rid, 60)
            k_ref, v_ref = reference_kv(model, ids)
            dk, dv = (got.k - k_ref).abs().max().item(), (got.v - v_ref).abs().max().item()
            good = got.num_tokens == n and dk < 1e-3 and dv < 1e-3
            ok &= good
            print(f"{rid}: {got.num_tokens} tokens, max|dK|={dk:.2e} max|dV|={dv:.2e} "
                  f"transfer {got.transfer_s * 1e3:.1f} ms -> {'OK' if good else 'MISMATCH'}")
            got.release()
        before = counters(http, args.metrics)
        http.post(args.prefill + "/v1/completions",
                  json={"model": "tiny-llama", "prompt": "plain", "max_tokens": 2}).raise_for_status()
        native = http.post(args.prefill + "/v1/completions", json={
            "model": "tiny-llama", "prompt": "native", "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        native.raise_for_status()
        has_native = bool((native.json().get("kv_transfer_params") or {}).get("remote_engine_id"))
        after = counters(http, args.metrics)
        moved = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        good = moved == {"expresslane_connector_unclaimed_requests_total": 2.0} and has_native
        ok &= good
        print(f"unmarked + native: counters moved {moved}; native kv_transfer_params: {has_native} -> "
              f"{'OK' if good else 'FAIL'}")
    finally:
        rx.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
