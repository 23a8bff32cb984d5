"""The two decode lanes: native (stock vLLM NixlConnector pool) and express (TileRT HTTP contract)."""
