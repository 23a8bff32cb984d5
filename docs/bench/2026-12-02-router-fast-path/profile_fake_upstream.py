"""vLLM-shaped canned replies for profiling the router (prefill leg + native decode leg). DELAY_S (env):
seconds of sleep before each completion reply (a model's time)."""
import asyncio, json, os, sys, uuid
DELAY_S = float(os.environ.get("DELAY_S", "0"))
from aiohttp import web

async def completions(request):
    body = await request.json()
    if DELAY_S:
        await asyncio.sleep(DELAY_S)
    n = len(body.get("prompt") or [])
    if body.get("kv_transfer_params", {}).get("do_remote_decode"):
        kvp = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
               "remote_engine_id": str(uuid.uuid4()), "remote_request_id": "cmpl-" + uuid.uuid4().hex,
               "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
    else:
        kvp = None
    out = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": 1, "model": body["model"],
           "choices": [{"index": 0, "text": " hello", "logprobs": None, "finish_reason": "length",
                        "stop_reason": None, "prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}],
           "service_tier": None, "system_fingerprint": None,
           "usage": {"prompt_tokens": n, "total_tokens": n + 1, "completion_tokens": 1, "prompt_tokens_details": None},
           "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": kvp}
    return web.json_response(out)

async def health(request):
    return web.Response(text="")

async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "tiny-llama", "max_model_len": 4096}]})

app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
