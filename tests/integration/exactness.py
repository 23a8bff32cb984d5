"""Prompt set and helpers for the cross-lane exactness tests.

Lengths are chosen around the paged-KV block size (128 on vLLM CPU) and the prefill's
--max-num-batched-tokens (512 in scripts/launch/common.sh), so prompts that span several blocks and
prompts whose prefill is chunked are both covered.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import httpx

BLOCK = 128
MAX_BATCHED = 512
# 1, block-1, block, block+1, several blocks, and two longer than --max-num-batched-tokens (chunked).
PROMPT_LENGTHS = [1, 2, 37, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 5, 3 * BLOCK, MAX_BATCHED + 77, 3 * MAX_BATCHED + 11]
MAX_TOKENS = 24
NATIVE_ALIAS = "tiny-llama"
EXPRESS_ALIAS = "tiny-llama-express"
REPO = Path(__file__).resolve().parents[2]


def token_prompt(length: int, salt: int = 0) -> list[int]:
    """A deterministic token-id prompt of exactly `length` ids: a window of the tokenized corpus the
    tiny model's tokenizer was trained on (whole UTF-8 characters only: random byte-level ids would
    make vLLM's own detokenizer leak prompt bytes into the first output text)."""
    ids = _corpus_ids()
    start = (salt * 7919) % len(ids)
    out = []
    while len(out) < length:
        out.extend(ids[start:start + length - len(out)])
        start = 0
    return out


@functools.lru_cache(maxsize=1)
def _corpus_ids() -> list[int]:
    from tokenizers import Tokenizer

    model_dir = Path(os.environ.get("EXPRESSLANE_TEST_MODEL_DIR", REPO / "var" / "models" / "tiny-llama"))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = (REPO / "scripts" / "bench_lib" / "tiny_model_corpus.txt").read_text()
    return tok.encode(text, add_special_tokens=False).ids


def chat_messages(length_words: int, salt: int = 0) -> list[dict]:
    words = ["river", "stone", "lamp", "orbit", "paper", "signal", "garden", "copper", "window", "thread"]
    text = " ".join(words[(i * 7 + salt) % len(words)] for i in range(length_words))
    return [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": f"Continue this list: {text}"},
    ]


def completion(client: httpx.Client, base: str, body: dict) -> dict:
    r = client.post(f"{base}/v1/completions", json=body)
    assert r.status_code == 200, f"{base}: {r.status_code} {r.text}"
    return r.json()


def chat(client: httpx.Client, base: str, body: dict) -> dict:
    r = client.post(f"{base}/v1/chat/completions", json=body)
    assert r.status_code == 200, f"{base}: {r.status_code} {r.text}"
    return r.json()


def stream_text(client: httpx.Client, base: str, path: str, body: dict) -> tuple[str, list[dict]]:
    """POST with stream=true; return the concatenated text and all parsed chunks. Checks SSE framing."""
    body = dict(body, stream=True)
    chunks: list[dict] = []
    text = []
    done = False
    with client.stream("POST", f"{base}{path}", json=body) as r:
        assert r.status_code == 200, f"{base}{path}: {r.status_code} {r.read()!r}"
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), f"not SSE: {line!r}"
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            assert not done, "data after [DONE]"
            chunk = json.loads(payload)
            chunks.append(chunk)
            for choice in chunk.get("choices", []):
                if "text" in choice:
                    text.append(choice["text"] or "")
                else:
                    text.append((choice.get("delta") or {}).get("content") or "")
    assert done, "stream did not end with data: [DONE]"
    return "".join(text), chunks
