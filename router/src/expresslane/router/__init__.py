"""expresslane router: the OpenAI-compatible front door for both lanes.

Run: `python -m expresslane.router --config compose/config/router.yaml` (env-interpolated YAML).
In-process: `create_app(load_config(path, os.environ))`, see `app.py`.

Layout
  __main__.py     the entrypoint: the only place the environment is read
  app.py          create_app: lifespan-owned upstream clients, routes, lane selection, error rendering
  config.py       typed RouterConfig + `${VAR:-default}` YAML loading (the only schema)
  resilience.py   the config's health and resilience sections; the per-request Deadline
  errors.py       exception hierarchy -> HTTP status + OpenAI-style error body
  metrics.py      per-app Prometheus registry (expresslane_router_*), per-request record
  json_codec.py   the request path's JSON coders, built once
  openai/         the OpenAI surface: request shapes, detokenizer, logprobs, tools, structured outputs, limits
  fleet/          discovery, health probes and breaker, outlier detection, the prefill pool, the express gate,
                  node capabilities
  upstream/       upstream HTTP: one error mapping, the line reader, the clients
  server/         serving, protocol, fast path, input limits, auth, secrets, endpoints, request log
  lanes/          native and express lanes, the prefill leg, the express node client, mid-stream failover
"""
