"""Fixtures for the router unit tests (the kit lives in _kit.py so test modules can import helpers)."""

from ._kit import eos_id, make_client, model_text, tokenizer, upstreams  # noqa: F401
