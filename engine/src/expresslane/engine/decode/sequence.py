"""One request's token loop, cut at the forward: what the engine does before a step and with its logits.

`SequenceRun` holds a request's sampler, drafter, position and the tokens it has yet to emit. A step is:

    for tok in run.emit(): ...  the pending tokens, appended to the Generation (stop rules applied on each)
    rows = run.plan()           the forward's rows for this request: its last token, then its drafts
    ...                         one forward computes logits [len(rows), vocab] for them at run.pos ..
    run.consume(logits)         verify / sample: the tokens to emit next, the position advanced

The batch-1 loop (DecodeEngine._run) runs one request this way, a forward a step; a node serving several users
(decode/batch.py) plans every active request's rows, runs ONE forward over all of them and gives each request its
own rows' logits. A request's tokens, logprobs and counters are the same either way: its rows' logits are the
same bits (the step is row-invariant: models/cpu_linear.py, models/lean.py) and it takes the same decisions from
them.

Speculation stays on under a grammar (the verify rows are masked through the matcher, decode/grammar.py) and with
logprobs (every kept row's logits give its token's logprobs). Rollback is the position: rows past
pos + len(kept) hold rejected drafts' K/V, are never read (attention stops at the live length) and are
overwritten.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from . import logprobs as lp
from .chain import greedy_accept
from .grammar import GrammarError
from .sampling import Sampler
from .speculative import Drafter


def finish_reason(token: int, num_output: int, limit: int, min_tokens: int, stop_ids: set[int]) -> str | None:
    """Why a stream ends after emitting `token` as its num_output-th token: "stop" (a stop id once min_tokens
    are out), "length" (the limit: max_tokens or max_seq_len), or None (it goes on)."""
    if token in stop_ids and num_output >= min_tokens:
        return "stop"
    if num_output >= limit:
        return "length"
    return None


class SequenceRun:
    """The per-token loop of one request (its Generation `gen`), a step at a time. `k`: the most drafts a step
    may verify (0: no speculation); `max_seq_len`: the cache length (prompt + output never pass it)."""

    def __init__(self, gen, first_token_id: int, sampler: Sampler, drafter: Drafter | None, *, k: int,
                 max_seq_len: int, device: torch.device) -> None:
        self.gen, self.sampler, self.drafter = gen, sampler, drafter
        self.k = k if drafter is not None else 0
        self.max_seq_len = max_seq_len
        self.device = device
        params = gen.params
        # prompt + output <= max_seq_len, like vLLM's max_model_len.
        self.limit = min(params.max_tokens, max_seq_len - gen.num_prompt_tokens)
        self.pos = gen.num_prompt_tokens  # where pending[-1] goes (its K/V is not in the cache yet)
        self.pending = [first_token_id]  # tokens to emit; the last one's KV is not in the cache yet
        self.pending_lp: list[lp.TokenLogprobs | None] = [None]  # the first token's come from the prefill
        self.drafts: list[int] = []
        if drafter is not None:
            drafter.start([*params.prompt_token_ids, first_token_id])
        with torch.inference_mode():
            sampler.observe(torch.tensor([first_token_id], dtype=torch.long, device=device))

    @property
    def finished(self) -> bool:
        return self.gen.finish_reason is not None

    def emit(self) -> Iterator[int]:
        """Append the pending tokens to the Generation one at a time, each yielded once it (and its logprobs) is
        there, stopping at the first that ends it."""
        gen, out, params = self.gen, self.gen.token_ids, self.gen.params
        want_lp = params.logprobs is not None
        pending, pending_lp = self.pending, self.pending_lp
        self.pending, self.pending_lp = [], []
        for tok, tlp in zip(pending, pending_lp):
            out.append(tok)
            if want_lp:
                gen.logprobs.append(None if tlp is None else tlp.logprob)
                gen.top_logprobs.append(None if tlp is None else tlp.top)
            gen.finish_reason = finish_reason(tok, len(out), self.limit, params.min_tokens, self.sampler.stop_ids)
            yield tok
            if gen.finish_reason:
                return

    def plan(self, rows_before: int = 0, max_drafts: int | None = None) -> list[int]:
        """This request's rows of the next forward, at positions pos ..: its last token and the drafts worth
        verifying (at most max_drafts), weighed against a step in which other requests put `rows_before` rows
        (decode/batch.py)."""
        out = self.gen.token_ids
        # Drafts never run past max_tokens / max_seq_len: the last verified row is position pos + len(drafts),
        # and the step emits at most len(drafts) + 1 tokens.
        room = min(self.limit - len(out) - 1, self.max_seq_len - self.pos - 1)
        if max_drafts is not None:
            room = min(room, max_drafts)
        self.drafts = []
        if self.drafter is not None and room > 0:
            set_rows = getattr(self.drafter, "set_batch_rows", None)
            if set_rows is not None:
                set_rows(rows_before)
            self.drafts = self.drafter.propose(min(self.k, room))
        return [out[-1], *self.drafts]

    @property
    def argmax_only(self) -> bool:
        """Its next tokens are its rows' argmaxes alone (plain greedy, no logprobs): a step over several users
        reads every such row's argmax with one host sync (decode/batch.py) and hands them to `consume`."""
        return self.sampler.plain_greedy and self.gen.params.logprobs is None

    @torch.inference_mode()
    def consume(self, logits: torch.Tensor, argmax: list[int] | None = None) -> None:
        """The step's logits for this request's rows ([1 + len(drafts), vocab] float32): the tokens it emits
        next, the position and the counters advanced. `argmax`: the rows' argmaxes, read already (only where
        `argmax_only`: the same tokens Sampler.sample / verify take for greedy). Raises GrammarError if the matcher
        refuses a token its own mask allowed."""
        gen, sampler, drafts = self.gen, self.sampler, self.drafts
        k_lp = gen.params.logprobs
        n_out = len(gen.token_ids)
        if argmax is not None:
            if not self.argmax_only:
                raise ValueError("argmax rows are for plain greedy requests without logprobs")
            pending = greedy_accept(drafts, argmax)
        elif drafts:
            logits = sampler.constrain(logits, drafts)
            pending = sampler.verify(logits, drafts, n_out)  # (no penalties here: they never speculate)
            if k_lp is not None:
                kept = torch.tensor(pending, dtype=torch.long, device=self.device)
                self.pending_lp = lp.unpack(lp.pack(logits[:len(pending)], kept, k_lp).tolist(), k_lp)
        else:
            logits = sampler.constrain(logits[-1:])
            token = sampler.sample(logits[-1], n_out)
            sampler.observe(token)
            if k_lp is not None:  # the token, its logprob and the top-k: one host sync
                self.pending_lp = lp.unpack(lp.pack(logits, token, k_lp).tolist(), k_lp)
                pending = [self.pending_lp[0].token]
            else:
                pending = [int(token.item())]  # the one host sync per token
        if k_lp is None:
            self.pending_lp = [None] * len(pending)
        if gen.grammar is not None:
            for tok in pending:
                if not gen.grammar.accept(tok):  # the mask allowed it: the matcher must take it
                    raise GrammarError(f"the grammar matcher refused token {tok} its own mask allowed")
        accepted = len(pending) - 1
        self.pos += 1 + accepted
        gen.spec.record(len(drafts), accepted)
        if self.drafter is not None:
            self.drafter.extend(pending)
        self.pending = pending
