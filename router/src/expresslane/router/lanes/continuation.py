"""Mid-stream failover: continue an express request on the native lane from its token history.

When an express node dies after tokens reached the client, the request goes on as a token-id completion on
the prefill + native decode path: prompt = the prompt's token ids + every token generated so far, the budget
that is left (`max_tokens`, `min_tokens`), the client's sampling settings. The native node's token ids
(`return_token_ids`) feed the SAME detokenizer / stop-rule assembler the express stream used, so the client
sees one unbroken stream of the same chunk shape. Greedy outputs stay exact (the native lane computes the
same argmax over the same context). Penalties that treat prompt and output tokens differently (presence /
frequency) see the stitched history as prompt, so only they may differ from a single-server run.
The native decode leg follows the native lane's own retry rule (NativeLane.decode_leg: a node that fails before
its first byte is tried again, at most resilience.native_retries times); a failover is never more fragile than a
native request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..errors import UpstreamError
from ..openai.request import RequestOptions
from ..resilience import Deadline
from .base import shielded
from .native import NativeLane, NativeStream, decode_body

__all__ = ["Continuation", "continuation_body"]

# Sampling fields forwarded verbatim to vLLM (which validated them on the prefill leg already); the fields the
# router itself interprets (min_tokens, ignore_eos, stop_token_ids) come from the typed request. Stop strings stay
# with the router's assembler.
_CARRY = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "seed", "skip_special_tokens", "spaces_between_special_tokens")


def continuation_body(client_body: dict[str, Any], opts: RequestOptions, model: str, history: list[int],
                      max_tokens_left: int, generated: int) -> dict[str, Any]:
    """The /v1/completions body that continues the request from `history` (prompt + generated token ids)."""
    out = {k: client_body[k] for k in _CARRY if client_body.get(k) is not None}
    if opts.ignore_eos:
        out["ignore_eos"] = True
    if opts.stop_token_ids:
        out["stop_token_ids"] = list(opts.stop_token_ids)
    out.update(model=model, prompt=list(history), max_tokens=max_tokens_left, stream=True, return_token_ids=True)
    min_left = opts.min_tokens - generated
    if min_left > 0:
        out["min_tokens"] = min_left
    return out


@dataclass
class Continuation:
    """The native side of one failover; `finish_reason` is the native node's, once its stream ended."""

    native: NativeLane
    pool: str
    finish_reason: str | None = None

    async def tokens(self, client_body: dict[str, Any], opts: RequestOptions, history: list[int],
                     max_tokens_left: int, generated: int, deadline: Deadline) -> AsyncIterator[list[int]]:
        native, cfg = self.native, self.native.ctx.config
        body = continuation_body(client_body, opts, cfg.native_model(self.pool), history, max_tokens_left, generated)
        path = "/v1/completions"
        model = cfg.native_model(self.pool)
        kvp, n_prompt = await native.prefill(body, path, deadline)

        async def attempt(url: str, kvp: dict[str, Any], _n: int) -> NativeStream:
            return await native.open_stream(self.pool, url, path, decode_body(body, model, kvp, force_usage=False),
                                            deadline)

        # the native lane's own retry rule: a failure before the first byte is tried again (native.decode_leg)
        st = await native.decode_leg(self.pool, kvp, n_prompt, attempt, lambda: native.prefill(body, path, deadline),
                                     deadline)
        url = st.url
        try:
            async for data in st.all_events():
                if data.strip() == "[DONE]":
                    return
                try:
                    obj = json.loads(data)
                except ValueError:
                    raise UpstreamError(f"decode node sent a bad SSE event: {data[:200]!r}", stage="decode") from None
                if not isinstance(obj, dict) or "error" in obj:
                    raise UpstreamError(f"mid-stream failover: the native node failed: {data[:300]}",
                                        stage="decode", kind="stream_error")
                for c in obj.get("choices") or ():
                    if not isinstance(c, dict):
                        continue
                    ids = c.get("token_ids")
                    if isinstance(ids, list) and ids:
                        yield [int(t) for t in ids]
                    if c.get("finish_reason"):
                        self.finish_reason = c["finish_reason"]
            raise UpstreamError(f"mid-stream failover: native node {url} ended the stream without [DONE]",
                                stage="decode", kind="truncated")
        finally:
            await shielded(st.stack.aclose())
