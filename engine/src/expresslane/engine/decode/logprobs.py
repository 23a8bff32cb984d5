"""Per-token logprobs with vLLM 0.32's default `logprobs_mode` ("raw_logprobs").

vLLM's Sampler computes `logits.log_softmax(dim=-1, dtype=torch.float32)` from the logits it is given, before
allowed_token_ids, bad words, min_tokens, logit_bias, penalties, temperature, top-k/top-p; the structured-output
bitmask is applied by the model runner BEFORE the sampler, so a constrained request's logprobs are those of the
masked logits (disallowed tokens -inf, the allowed ones renormalised). The top list is `torch.topk(logprobs, k)`
(descending, topk's order for ties). The node does the same on the device, from the same logits the sampler
uses (masked by the grammar when there is one), and brings the sampled ids, their logprobs and the top-k
back in ONE transfer per step (`pack(...).tolist()`): on a plain step that is the step's only host sync (it
replaces reading the sampled token), after a verify step one more (the kept tokens are known only then).

Ids travel as float64 in the packed tensor: exact for any vocabulary (< 2**53).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob), logprob descending, len == top_logprobs


def pack(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [T, vocab] (the sampler's input rows, grammar-masked), tokens [T] long on the same device ->
    float64 [T, 2 + 2k]: (token, its logprob, k top logprobs, k top ids)."""
    lp = logits.log_softmax(dim=-1, dtype=torch.float32)
    cols = [tokens[:, None].to(torch.float64), lp.gather(1, tokens[:, None]).to(torch.float64)]
    if k:
        vals, ids = lp.topk(k, dim=-1)
        cols += [vals.to(torch.float64), ids.to(torch.float64)]
    return torch.cat(cols, dim=1)


def unpack(rows: list[list[float]], k: int) -> list[TokenLogprobs]:
    """The host copy of `pack`'s result (one `.tolist()`)."""
    out = []
    for r in rows:
        top = [(int(r[2 + k + j]), r[2 + j]) for j in range(k)]
        out.append(TokenLogprobs(int(r[0]), r[1], top))
    return out
