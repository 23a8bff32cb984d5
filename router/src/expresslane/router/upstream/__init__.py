"""Upstream HTTP: how the router talks to vLLM servers and express nodes.

  errors.py             one mapping of transport failures and replies to the router's typed errors
  lines.py              a streamed reply's lines, every wait bounded (LineReader)
  calls.py              one-shot calls (OneShotCalls) and streams through the router's httpx.AsyncClient
  h1_pool.py            the keep-alive HTTP/1.1 client of the one-shot calls
  aiohttp_transport.py  aiohttp as the httpx transport of the streams
"""
