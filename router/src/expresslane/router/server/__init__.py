"""The router's own HTTP server side: serving, the front door's checks, and the endpoints beside completions.

  serving.py        uvicorn without its housekeeping tick (RouterServer, serve)
  http_protocol.py  uvicorn's httptools protocol, one write per reply; a ClientWatch per request
  fastpath.py       the two completion routes answered below Starlette
  limits.py         body size and JSON depth limits, the one place a body is read
  auth.py           client API keys (constant-time check, per-key lanes and rate)
  secrets.py        the router's secrets from the environment or secret files
  endpoints.py      model cards, tokenize / detokenize, version, the Responses API answer
  requestlog.py     request ids, access log, JSON log lines
"""
