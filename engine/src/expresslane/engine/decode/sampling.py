"""Sampling parameters and a per-request sampler that never syncs with the host.

Order of operations follows vLLM's V1 sampler: float32 logits (grammar-masked: `constrain`) -> allowed_token_ids
-> min_tokens (stop ids masked; with a grammar they come back when nothing else is left, as vLLM does) ->
logit_bias -> penalties (repetition, frequency, presence; over the tokens THIS request has produced, first token
included) -> greedy argmax when temperature == 0, else temperature -> min_p -> top-k / top-p -> sample with the
exponential-race trick (argmax(probs / Exp(1)), no torch.multinomial and no host sync).

Speculative verification (`Sampler.verify`) applies the same processing to each of the T rows of a verify
forward and keeps the target distribution: greedy keeps drafts while they equal the row's argmax; sampling
is standard rejection sampling for a drafter that proposes one token with certainty (prompt lookup, a greedy
draft model): keep draft d with probability p(d), else sample from p with d removed (renormalising is
implicit: the exponential race is scale-free); after k kept drafts, one more token from the last row. The
penalties depend on every earlier token, so requests that use them decode without speculation.

Structured outputs (`grammar`, decode/grammar.py): `constrain` applies the request's xgrammar token bitmask to
the logits rows in place before anything else, as vLLM's model runner does before its sampler (so logprobs,
decode/logprobs.py, are those of the masked logits, vLLM's raw_logprobs). Verify rows are masked through the
matcher row by row, so speculation stays exact under a grammar.

Deviation from vLLM, by construction: the decode node never sees the prompt's token ids (only its KV),
so repetition_penalty covers generated tokens unless the caller passes prompt_token_ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .logprobs import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from .grammar import RequestGrammar

_SAMPLING_EPS = 1e-5

HONOURED_SAMPLING_OPTIONS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "logit_bias",
    "allowed_token_ids",
)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_token_ids: tuple[int, ...] = field(default=(), repr=False)
    # Per-request opt-out of speculative decoding (on by default where the engine has it configured).
    # prompt_token_ids, when given, are also the context prompt lookup drafts from.
    speculative: bool = True
    # None: no logprobs; 0..MAX_TOP_LOGPROBS: each token's logprob plus that many top alternatives.
    logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is not allowed to be empty")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (it counts the first token), got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def check_vocab(self, vocab_size: int) -> None:
        named = {"stop_token_ids": self.stop_token_ids, "prompt_token_ids": self.prompt_token_ids,
                 "allowed_token_ids": self.allowed_token_ids or (), "logit_bias": [t for t, _ in self.logit_bias]}
        for name, ids in named.items():
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} outside the vocabulary [0, {vocab_size}): {bad[:5]}")


class Sampler:
    """Per-request device state: output token counts, RNG, stop-id mask. `sample` returns a [1] long tensor."""

    def __init__(
        self, params: SamplingParams, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device,
        grammar: "RequestGrammar | None" = None,
    ) -> None:
        self.params = params
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.device = device
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        # vLLM's min_tokens masks all_stop_token_ids: the eos ids even with ignore_eos, plus stop_token_ids.
        min_tokens_ids = set(params.stop_token_ids) | set(eos_token_ids)
        self._min_tokens_ids = (
            torch.tensor(sorted(min_tokens_ids), dtype=torch.long, device=device)
            if params.min_tokens > 1 and min_tokens_ids
            else None
        )
        self._use_counts = params.presence_penalty != 0 or params.frequency_penalty != 0
        self._use_rep = params.repetition_penalty != 1.0
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self._ones = torch.ones(1, dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if params.prompt_token_ids and self._use_rep:
            ids = torch.tensor(params.prompt_token_ids, dtype=torch.long, device=device)
            self.prompt_mask[ids] = True
        self.generator: torch.Generator | None = None
        if not params.greedy and params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        self._disallowed: torch.Tensor | None = None  # True where allowed_token_ids excludes the token
        if params.allowed_token_ids is not None:
            self._disallowed = torch.ones(vocab_size, dtype=torch.bool, device=device)
            self._disallowed[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)] = False
        self._bias: torch.Tensor | None = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
            self._bias.index_put_((ids,), torch.tensor([b for _, b in params.logit_bias], device=device),
                                  accumulate=False)
        self._top_k = params.top_k if 0 < params.top_k < vocab_size else 0
        self._top_p = params.top_p if params.top_p < 1.0 else 0.0

    @property
    def plain_greedy(self) -> bool:
        """The next token is the argmax of the step's logits alone: greedy with no grammar, allowed-token mask,
        min_tokens mask, logit bias or penalty (decode/chain.py runs that argmax on the device)."""
        return (self.params.greedy and self.grammar is None and self._disallowed is None
                and self._min_tokens_ids is None and self._bias is None and not self._use_rep
                and not self._use_counts)

    @property
    def supports_speculation(self) -> bool:
        """Penalties see every earlier token, so per-row processing of a verify block would not be exact."""
        return not (self._use_counts or self._use_rep)

    def _restore_if_empty(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """vLLM's min_tokens under structured output: a row that masking the stop ids left all -inf (the grammar
        allows only them) keeps them."""
        if self.grammar is None:
            return masked
        return torch.where(torch.isneginf(masked).all(dim=-1, keepdim=True), logits, masked)

    def constrain(self, logits: torch.Tensor, drafts: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """Apply the grammar's bitmask in place to logits [T, vocab] (T = len(drafts) + 1; row i after
        drafts[:i]); a no-op without a grammar. Returns logits."""
        if self.grammar is not None:
            self.grammar.apply(logits, drafts)
        return logits

    def observe(self, token: torch.Tensor) -> None:
        """Record an output token (a [1] long device tensor) for the penalties."""
        if self._use_counts or self._use_rep:
            self.counts.index_add_(0, token, self._ones)

    def sample(self, logits: torch.Tensor, num_output_tokens: int) -> torch.Tensor:
        """logits: [vocab] float32 for the next position; num_output_tokens already produced (host int)."""
        p = self.params
        if self._disallowed is not None:
            logits = logits.masked_fill(self._disallowed, float("-inf"))
        if self._min_tokens_ids is not None and num_output_tokens < p.min_tokens:
            masked = logits.index_fill(0, self._min_tokens_ids, float("-inf"))
            logits = self._restore_if_empty(logits, masked)
        if self._bias is not None:
            logits = logits + self._bias
        if self._use_rep:
            seen = (self.counts > 0) | self.prompt_mask
            penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        if self._use_counts:
            logits = logits - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0)
        if p.greedy:
            return logits.argmax(dim=-1, keepdim=True)
        probs = self._probs(logits)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        return probs.div(q).argmax(dim=-1, keepdim=True)


    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's order after the penalties, for sampling: temperature, min_p, top-k / top-p, softmax."""
        p = self.params
        logits = logits / p.temperature
        if p.min_p:
            logits = _min_p(logits, p.min_p)
        if self._top_k or self._top_p:
            logits = _top_k_top_p(logits, self._top_k, self._top_p)
        return logits.softmax(dim=-1)

    def verify(self, logits: torch.Tensor, drafts: list[int], num_output_tokens: int) -> list[int]:
        """logits: [k+1, vocab] float32 of a verify forward over (current token, d1..dk); row i is the next-token
        distribution after d1..di. Returns the tokens to emit: the kept drafts, then the target's own token
        (1..k+1 tokens). One host sync."""
        p = self.params
        k = len(drafts)
        if self._disallowed is not None:
            logits = logits.masked_fill(self._disallowed, float("-inf"))
        if self._min_tokens_ids is not None and num_output_tokens < p.min_tokens:
            rows = torch.arange(k + 1, device=logits.device)[:, None]
            masked = (num_output_tokens + rows) < p.min_tokens
            cols = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            cols[self._min_tokens_ids] = True
            logits = self._restore_if_empty(logits, logits.masked_fill(masked & cols[None, :], float("-inf")))
        if self._bias is not None:
            logits = logits + self._bias
        d = torch.tensor(drafts, dtype=torch.long, device=logits.device)
        if p.greedy:
            target = logits.argmax(dim=-1).tolist()
            n = 0
            while n < k and drafts[n] == target[n]:
                n += 1
            return drafts[:n] + [target[n]]
        probs = self._probs(logits)
        p_draft = probs[:-1].gather(1, d[:, None]).squeeze(1)  # [k]
        u = torch.rand(k, device=probs.device, generator=self.generator)
        accept = (u < p_draft).long()
        residual = probs[:-1].scatter(1, d[:, None], 0.0)  # p with the draft removed (unnormalised)
        race = torch.cat([residual, probs[-1:]]).div_(
            torch.empty_like(probs).exponential_(generator=self.generator)).argmax(dim=-1)  # [k+1]
        decided = torch.cat([accept, race]).tolist()
        keep, own = decided[:k], decided[k:]
        n = 0
        while n < k and keep[n]:
            n += 1
        return drafts[:n] + [own[n]]


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM's MinPLogitsProcessor: drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """vLLM's apply_top_k_top_p over the last dim ([vocab] or [rows, vocab]; k=0 / p=0.0 mean off)."""
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    if k:
        kth = sorted_logits[..., -k:-k + 1] if k > 1 else sorted_logits[..., -1:]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if p:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p
        drop[..., -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
