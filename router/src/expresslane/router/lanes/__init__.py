"""The two lanes a request can take, and the prefill leg they share.

  base.py             the per-app LaneContext, shielded cleanup, ManagedStream
  prefill.py          one-token prefill-leg bodies, first token / prompt ids, TileRT's rid rule
  native.py           prefill -> stock vLLM NixlConnector decode, SSE relay, retries
  express.py          gate -> reserve -> prefill -> /pd/decode -> detokenize; spill, failover
  express_node.py     calls to one express node (/pd/reserve, /pd/decode, /pd/cancel), typed outcomes
  express_options.py  what the express lane's node kinds can honour; sampling for /pd/decode
  express_output.py   the express answer as OpenAI JSON or SSE
  continuation.py     mid-stream failover: the rest of an express answer on the native lane
"""
