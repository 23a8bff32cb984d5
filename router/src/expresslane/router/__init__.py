"""expresslane router: the OpenAI-compatible front door for both lanes.

Run: `python -m expresslane.router --config compose/config/router.yaml` (env-interpolated YAML).
In-process: `create_app(load_config(path, os.environ))`, see `app.py`.

Modules
  config.py         typed RouterConfig + `${VAR:-default}` YAML loading (the only schema)
  errors.py         exception hierarchy -> HTTP status + OpenAI-style error body
  app.py            create_app: lifespan (one pooled httpx.AsyncClient), routes, lane selection, auth
  openai_shapes.py  light request validation, vLLM-shaped responses/chunks, SSE framing/parsing
  upstream.py       upstream calls with one error mapping (4xx passthrough, 502/503/504)
  prefill.py        one-token prefill-leg bodies, first token / prompt ids, TileRT rid rule
  lanes/native.py   prefill -> stock vLLM NixlConnector decode (least outstanding node), SSE relay
  lanes/express.py  gate -> prefill -> /pd/decode (TileRT contract) -> detokenize; cancel + release
  lanes/base.py     shared context, ManagedStream (cleanup on every exit), shielded cleanup
  gate.py           one request per express node, bounded FIFO queue with timeout
  detokenizer.py    incremental detokenizer (UTF-8 safe) + vLLM stop/EOS/length rules
  metrics.py        per-app Prometheus registry (expresslane_router_*), per-request record
"""
