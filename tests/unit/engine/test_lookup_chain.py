"""The greedy chain under speculation (decode/chain.py, DecodeEngine._run_chain) is the speculating per-token
loop with its plain steps queued one ahead: the same tokens, stop reasons, cache state, drafter calls and
speculation counters as the same engine with `greedy_chain = False` (the unchained loop), and the tokens of
speculation off.

Drafters: the real prompt lookup (behind the adaptive wrapper, as the server runs it) over prompts whose lookup
context holds the answer (most drafts kept), never repeats (no drafts), or holds a corrupted copy (mixed); and
an oracle drafter that knows the reference continuation and proposes by a plan (no draft, right drafts, drafts
wrong from row 0 or from a later row) so every transition of the chain's two states happens at known points.
Every run records the drafter's calls (the context it saw, the k it was asked for, what it answered) and
checks the cache rows past the last row the plain loop writes for the request's limit are never touched (a
sentinel). On a CUDA device the same tests run the CUDA graphs (the lean step where it applies); the tests at
the end run the other GPU step kinds."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams, SpeculationConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]  # no token twice: nothing for the lookup to match
MAX_SEQ = 128
N_NEW = 40
SENTINEL = 1234.5  # finite: a masked attention that multiplies it by zero stays finite
# The sweeps over where a stream ends: every point on CPU; every third on a GPU (the same logic, and the GPU run
# stays short).
SWEEP = range(0, N_NEW) if DEVICE == "cpu" else range(0, N_NEW, 3)


class RecordingDrafter:
    """Wraps a drafter and records every call with the context the drafter has seen so far (the hint
    may_draft_next is passed through, not recorded)."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log
        self.context: list[int] = []

    def start(self, context):
        self.context = list(context)
        self.log.append(("start", tuple(self.context)))
        self.inner.start(context)

    def propose(self, k):
        drafts = self.inner.propose(k)
        self.log.append(("propose", len(self.context), k, tuple(drafts)))
        return drafts

    def extend(self, tokens):
        self.context += tokens
        self.log.append(("extend", tuple(tokens)))
        self.inner.extend(tokens)

    def may_draft_next(self):  # read-only, and only the chain asks: not recorded
        may = getattr(self.inner, "may_draft_next", None)
        return may is None or may()


class OracleDrafter:
    """Knows the reference output (`reference[i]` is output token i) and proposes by plan(c) -> (m, right) at
    its c-th proposal: m drafts, the first `right` of them the reference's, the rest wrong. Its hint
    `may_draft_next` is honest (the plan's next entry) or, blind, always "no" (wrong wherever the plan drafts:
    the engine's path for drafts proposed while a step is queued)."""

    def __init__(self, num_prompt: int, reference: list[int], plan, vocab: int, blind: bool = True) -> None:
        self.num_prompt, self.reference, self.plan, self.vocab, self.blind = num_prompt, reference, plan, vocab, blind
        self.n = self.calls = 0

    def may_draft_next(self) -> bool:
        return not self.blind and self.plan(self.calls)[0] > 0

    def start(self, context):
        self.n, self.calls = len(context), 0

    def extend(self, tokens):
        self.n += len(tokens)

    def propose(self, k):
        i = self.n - self.num_prompt  # output tokens so far
        m, right = self.plan(self.calls)
        self.calls += 1
        m = min(m, k, len(self.reference) - i)
        return [self.reference[i + j] if j < right else (self.reference[i + j] + 1) % self.vocab
                for j in range(m)]


# A draft after a plain step is proposed with the chain's step queued (AHEAD); one right after a verify is not.
MIXED = [(0, 0), (0, 0), (3, 3), (0, 0), (2, 0), (0, 0), (0, 0), (4, 1), (0, 0), (1, 1), (0, 0), (2, 2),
         (4, 4), (0, 0), (1, 0), (2, 1), (0, 0), (0, 0), (0, 0), (4, 0)]


def mixed_plan(c: int) -> tuple[int, int]:
    """Plain steps, and after them every kind of verify: all kept, wrong from row 0, cut short."""
    return MIXED[c % len(MIXED)]


def wrong_first_plan(c: int) -> tuple[int, int]:
    return (2, 0) if c % 3 == 2 else (0, 0)


# One draft at a time, right and wrong, after a plain step: the verify's second row is the chain's next step.
SINGLE = [(0, 0), (1, 1), (0, 0), (1, 0), (1, 0), (0, 0), (1, 1), (0, 0), (1, 0), (0, 0), (0, 0)]


def single_plan(c: int) -> tuple[int, int]:
    return SINGLE[c % len(SINGLE)]


PLANS = {"none": lambda c: (0, 0), "always_right": lambda c: (4, 4), "mixed": mixed_plan,
         "wrong_first": wrong_first_plan, "single": single_plan}


@pytest.fixture(scope="module")
def engines(hf_model):
    _, path, _ = hf_model
    kw = dict(attention="split") if DEVICE == "cuda" else {}
    spec = DecodeEngine.from_pretrained(path, device=DEVICE, max_seq_len=MAX_SEQ, **kw)
    plain = DecodeEngine.from_pretrained(path, device=DEVICE, max_seq_len=MAX_SEQ, speculation=None, **kw)
    return spec, plain


@contextlib.contextmanager
def drafter(engine: DecodeEngine, make, log: list):
    engine.set_drafter(lambda: RecordingDrafter(make(), log))
    try:
        yield
    finally:
        engine.set_drafter(None)


@contextlib.contextmanager
def counted_forwards(engine: DecodeEngine):
    """Counts StepRunner.forward calls (the verify forwards; the chain's steps go through greedy_step)."""
    calls: list[tuple[int, int]] = []
    forward = engine.runner.forward

    def counting(tokens, start_pos):
        calls.append((len(tokens), start_pos))
        return forward(tokens, start_pos)

    engine.runner.forward = counting
    try:
        yield calls
    finally:
        del engine.runner.forward


def run(engine: DecodeEngine, prompt, chain: bool = True, cancel_after: int | None = None, **params) -> dict:
    """One greedy request; the cache rows past the last one the plain loop may write hold SENTINEL
    beforehand, and `untouched` says whether they still do; `forwards`: its StepRunner.forward calls (T, start)."""
    engine.greedy_chain = chain
    try:
        first = int(engine.prefill(prompt).argmax())
        params.setdefault("prompt_token_ids", prompt)
        params.setdefault("ignore_eos", True)
        sp = SamplingParams(**params)
        limit = min(sp.max_tokens, engine.max_seq_len - len(prompt))
        last_row = len(prompt) + limit - 2  # the plain loop's last forward: output token limit - 1 goes there
        k, v = engine.cache.k, engine.cache.v
        k[:, last_row + 1:] = SENTINEL
        v[:, last_row + 1:] = SENTINEL
        cancel = threading.Event()
        gen = engine.generate(first, len(prompt), sp, cancel_event=cancel)
        out = []
        with counted_forwards(engine) as forwards:
            for tok in gen:
                out.append(tok)
                if cancel_after is not None and len(out) == cancel_after:
                    cancel.set()
        untouched = bool((k[:, last_row + 1:] == SENTINEL).all() and (v[:, last_row + 1:] == SENTINEL).all())
        return {"tokens": out, "finish": gen.finish_reason, "cached": engine.cached_tokens,
                "spec": gen.spec.as_dict(), "untouched": untouched, "split": gen.split_verifies,
                "forwards": forwards}
    finally:
        engine.greedy_chain = True


def same_as_unchained(chained: dict, unchained: dict) -> None:
    for key in ("tokens", "finish", "cached", "spec"):
        assert chained[key] == unchained[key], (key, chained[key], unchained[key])
    assert chained["untouched"] and unchained["untouched"]


def reference(plain: DecodeEngine, prompt=PROMPT, n=N_NEW) -> list[int]:
    return run(plain, prompt, max_tokens=n)["tokens"]


def compare(spec, plain, make_drafter, prompt=PROMPT, **params) -> dict:
    """Chained vs unchained (same drafter, calls recorded) vs speculation off."""
    logs: tuple[list, list] = ([], [])
    results = []
    for chain, log in zip((True, False), logs):
        with drafter(spec, make_drafter, log):
            results.append(run(spec, prompt, chain=chain, **params))
    chained, unchained = results
    same_as_unchained(chained, unchained)
    assert logs[0] == logs[1], "the drafter saw different calls under the chain"
    if "cancel_after" in params:  # a verify's tokens all go out before the cancel is seen: a prefix
        ref = run(plain, prompt, **{**params, "cancel_after": None})
        assert chained["tokens"] == ref["tokens"][:len(chained["tokens"])]
    else:
        ref = run(plain, prompt, **params)
        assert chained["tokens"] == ref["tokens"] and chained["finish"] == ref["finish"]
    assert ref["untouched"]
    chained["log"] = logs[0]
    return chained


# ------------------------------------------------------------------ token identity, real prompt lookup
def test_prompt_lookup_context_holds_the_answer(engines):
    """Most drafts kept (a code-edit request copying its input)."""
    spec, plain = engines
    ref = reference(plain)
    got = compare(spec, plain, SpeculationConfig().drafter, max_tokens=N_NEW, prompt_token_ids=PROMPT + ref)
    assert got["tokens"] == ref
    assert got["spec"]["accepted_tokens"] >= N_NEW // 2, got["spec"]


def test_prompt_lookup_never_repeats(engines):
    """No n-gram the lookup matches (3-grams and longer here) recurs in the context: every step is a plain step
    on the chain, started once."""
    spec, plain = engines
    ref = reference(plain)
    context = PROMPT + ref
    ngrams = [tuple(context[i:i + 3]) for i in range(len(context) - 2)]
    assert len(set(ngrams)) == len(ngrams), "the random weights repeat a 3-gram: not the all-plain case"
    got = compare(spec, plain, SpeculationConfig(ngram_min=3).drafter, max_tokens=N_NEW)
    assert got["spec"]["verify_steps"] == 0 and got["spec"]["plain_steps"] == N_NEW - 1
    assert got["forwards"] == [] and got["split"] == 0


def test_prompt_lookup_mixed(engines):
    """A lookup context with the answer corrupted every few tokens: drafts kept, cut short and rejected."""
    spec, plain = engines
    ref = reference(plain)
    corrupt = [t if i % 7 != 3 else (t + 5) % spec.vocab_size for i, t in enumerate(ref)]
    got = compare(spec, plain, SpeculationConfig().drafter, max_tokens=N_NEW, prompt_token_ids=PROMPT + corrupt)
    s = got["spec"]
    assert s["accepted_tokens"] > 0 and s["drafted_tokens"] > s["accepted_tokens"] and s["plain_steps"] > 0, s


@pytest.mark.parametrize("ngram", [(1, 1), (2, 4), (3, 3), (1, 3), (3, 4)])
def test_lookup_hint_is_never_wrong_when_it_says_no(ngram):
    """PromptLookupDrafter.may_draft_next() with hint_ngram_min = ngram_min (every key length asked) False: for
    every next token, the proposal after it is empty (checked exhaustively over a 5-token vocabulary, where
    repeats and self-overlaps like "a a a" are common); and it does say no (else the chain would never run
    ahead under prompt lookup). (3, 4) is the default hint's own key lengths."""
    import copy
    import random

    from expresslane.engine.decode import PromptLookupDrafter

    rng = random.Random(0)
    said_no = 0
    for _ in range(300):
        d = PromptLookupDrafter(*ngram, hint_ngram_min=ngram[0])
        d.start([rng.randrange(5) for _ in range(rng.randrange(1, 9))])
        for _ in range(rng.randrange(0, 6)):
            d.extend([rng.randrange(5)])
        if d.may_draft_next():
            continue
        said_no += 1
        for t in range(5):
            e = copy.deepcopy(d)
            e.extend([t])
            assert e.propose(4) == [], (d.tokens, t)
    if ngram[0] > 1:  # with 1-grams any token seen before matches: then it rightly never says no
        assert said_no >= 20


def test_the_default_hint_leaves_out_2_grams():
    """The default hint asks 3- and 4-gram keys only: a "no" where only a 2-gram follows (then the chain splits
    that verify: exact, one more forward), and on random tokens it stops saying "may" where the last token alone
    was seen before. At a 32k context over Llama 3's vocabulary the exact hint says "may" at about a fifth of
    the steps and no proposal follows any of them; the default says it at almost none."""
    import random

    from expresslane.engine.decode import PromptLookupDrafter

    d = PromptLookupDrafter()  # ngram 2..4, the hint from 3
    d.start([5, 6, 1, 2, 7])
    assert not d.may_draft_next()  # "7" heads the 2-gram key "7 x" only if seen before: not here
    d.extend([1])  # "1" heads "1 2": the exact hint says may, the default (no 3-gram "7 1 x") says no
    exact = PromptLookupDrafter(hint_ngram_min=2)
    exact.start([5, 6, 1, 2, 7, 1])
    assert exact.may_draft_next() and not d.may_draft_next()
    d.extend([2])
    assert d.propose(4) == [7, 1, 2]  # the 2-gram proposal after the "no" is still made (a split verify)
    d.extend([7])  # "1 2 7" -> "2 7" heads the 3-gram key "2 7 1"
    assert d.may_draft_next()

    rng = random.Random(0)
    context = [rng.randrange(128256) for _ in range(32768)]
    rates = {}
    for hint_min in (2, 3):
        d = PromptLookupDrafter(hint_ngram_min=hint_min)
        d.start(context)
        said, followed = 0, 0
        for _ in range(2000):
            may = d.may_draft_next()
            d.extend([rng.randrange(128256)])
            said += may
            followed += may and bool(d.propose(4))
        rates[hint_min] = (said / 2000, followed)
    assert rates[2][0] > 0.15 and rates[2][1] == 0, rates
    assert rates[3][0] < 0.002, rates


def test_adaptive_hint_says_no_where_drafting_does_not_pay():
    """The adaptive wrapper's hint: no while drafting does not pay and no probe is due (the chain then queues
    the next plain step), the inner drafter's answer otherwise (tests/unit/engine/test_adaptive_drafter.py
    covers the policy)."""
    from expresslane.engine.decode import AdaptiveDrafter, PromptLookupDrafter, StepCosts

    costly = StepCosts((0, 1), (1.0, 1.5), (1.0, 1.5))
    d = AdaptiveDrafter(PromptLookupDrafter(2, 2), costly, pause=2)
    d.start([1, 2, 3, 1, 2])
    assert d.may_draft_next()  # "2 3" is a key: after a 3, a draft (the prior pays for one)
    assert d.propose(4) == [3]  # "1 2" was followed by 3
    d.extend([5])  # a miss: alpha 1.6 / 3.4 = 0.47, and a draft costs half a step: no longer worth it
    assert d.pause == 4  # and the pause doubles
    for tok in (1, 2, 3):
        assert not d.may_draft_next() and d.propose(4) == []
        d.extend([tok])
    # asked after the third plain step: the next proposal follows a fourth, when a probe is due; "3 x" heads keys
    assert d.may_draft_next()
    assert d.propose(4) == [] and d.since_verify == 3  # this step's own proposal is still inside the pause
    d.extend([1])
    assert d.propose(4) == [2]  # the probe: "3 1" was followed by 2


# ------------------------------------------------------------------ every transition, an oracle drafter
@pytest.mark.parametrize("blind", [True, False], ids=["blind-hint", "honest-hint"])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_oracle_plans_are_exact(engines, plan, blind):
    spec, plain = engines
    ref = reference(plain)
    got = compare(spec, plain, lambda: OracleDrafter(len(PROMPT), ref, PLANS[plan], spec.vocab_size, blind),
                  max_tokens=N_NEW)
    assert got["tokens"] == ref
    s = got["spec"]
    if plan == "none":  # one chain, started once
        assert s["verify_steps"] == 0 and got["forwards"] == [] and spec._chain.submitted == N_NEW - 1
    if plan == "mixed" and blind:  # verifies entered with a step queued: kept (two forwards) and rejected
        assert got["split"] >= 3 and s["accepted_histogram"][0] >= 2, (got["split"], s)
    if not blind:  # an honest hint: no step is queued where drafts come, every verify is one forward
        assert got["split"] == 0 and len(got["forwards"]) == s["verify_steps"], (got["forwards"], s)


def test_an_honest_hint_keeps_plain_steps_ahead(engines):
    """Between the drafts of the mixed plan, every plain step whose successor is plain was queued ahead: the
    chain's steps are the plain steps (one each), and no verify is split."""
    spec, plain = engines
    ref = reference(plain)
    with drafter(spec, lambda: OracleDrafter(len(PROMPT), ref, lambda c: (0, 0) if c % 6 else (2, 2),
                                             spec.vocab_size, blind=False), []):
        got = run(spec, PROMPT, max_tokens=N_NEW)
    s = got["spec"]
    assert got["tokens"] == ref and got["split"] == 0 and len(got["forwards"]) == s["verify_steps"] > 0
    assert s["plain_steps"] >= N_NEW // 2, s


def test_a_draft_wrong_at_row_0_costs_no_verify_forward(engines):
    """Drafts proposed after plain steps and wrong from their first token: the queued step already holds the
    target's token, so no verify forward runs at all (a mutation that skips the draft[0] check and verifies
    anyway fails here)."""
    spec, plain = engines
    ref = reference(plain)
    with drafter(spec, lambda: OracleDrafter(len(PROMPT), ref, wrong_first_plan, spec.vocab_size), []):
        got = run(spec, PROMPT, max_tokens=N_NEW)
    assert got["tokens"] == ref
    assert got["spec"]["verify_steps"] >= N_NEW // 3 - 1 and got["spec"]["accepted_tokens"] == 0, got["spec"]
    assert got["forwards"] == [] and got["split"] == 0


def test_single_drafts_with_a_step_queued_cost_no_verify_forward(engines):
    """One draft at a time (the adaptive drafter's probes) proposed with a step queued (a blind hint): right or
    wrong, no verify forward (the verify's second row is the chain's next step; after a wrong draft, in a row,
    the stream stays ahead), the same tokens and counters as the unchained loop."""
    spec, plain = engines
    ref = reference(plain)
    got = compare(spec, plain, lambda: OracleDrafter(len(PROMPT), ref, single_plan, spec.vocab_size),
                  max_tokens=N_NEW)
    s = got["spec"]
    assert got["tokens"] == ref and got["forwards"] == []
    assert s["verify_steps"] >= 8 and 0 < s["accepted_tokens"] < s["verify_steps"], s
    assert got["split"] == s["accepted_tokens"]  # each kept draft: two 1-row steps


def test_a_kept_first_draft_verifies_the_rest_from_the_next_row(engines):
    """The verify after a queued step whose first draft is kept: one forward of the drafts at the next row."""
    spec, plain = engines
    ref = reference(plain)
    plan = lambda c: (3, 3) if c == 3 else (0, 0)  # noqa: E731  (propose c sees c + 1 tokens out)
    with drafter(spec, lambda: OracleDrafter(len(PROMPT), ref, plan, spec.vocab_size), []):
        got = run(spec, PROMPT, max_tokens=N_NEW)
    assert got["tokens"] == ref and got["split"] == 1
    # 4 tokens out, the 4th at row len(PROMPT) + 3; the queued step is that row; the drafts go from the next.
    assert got["forwards"] == [(3, len(PROMPT) + 4)]
    assert got["spec"]["accepted_histogram"] == [0, 0, 0, 1]


# ------------------------------------------------------------------ every way a stream ends
@pytest.mark.parametrize("plan", ["mixed", "always_right", "single"])
def test_the_limit_at_every_point(engines, plan):
    """max_tokens = 1 .. N: the limit lands on plain steps, on the queued step, inside verifies."""
    spec, plain = engines
    ref = reference(plain)
    for n in (n + 1 for n in SWEEP):
        got = compare(spec, plain, lambda: OracleDrafter(len(PROMPT), ref, PLANS[plan], spec.vocab_size),
                      max_tokens=n)
        assert got["tokens"] == ref[:n] and got["finish"] == "length", n


def test_max_seq_len_is_the_limit(engines):
    spec, plain = engines
    prompt = (PROMPT * 11)[:MAX_SEQ - 9]
    ref = run(plain, prompt, max_tokens=100)["tokens"]
    assert len(ref) == 9
    for plan in ("mixed", "always_right", "none", "single"):
        got = compare(spec, plain, lambda: OracleDrafter(len(prompt), ref, PLANS[plan], spec.vocab_size), prompt,
                      max_tokens=100)
        assert got["tokens"] == ref and got["cached"] == MAX_SEQ - 1


@pytest.mark.parametrize("plan", ["mixed", "always_right", "single"])
def test_a_stop_token_at_every_point(engines, plan):
    """The stop id of each output position in turn: after a draft, inside kept drafts, on a plain step."""
    spec, plain = engines
    ref = reference(plain)
    for j in SWEEP:
        stop = ref[j]
        got = compare(spec, plain, lambda: OracleDrafter(len(PROMPT), ref, PLANS[plan], spec.vocab_size),
                      max_tokens=N_NEW, stop_token_ids=[stop], min_tokens=1)
        cut = ref.index(stop)
        assert got["tokens"] == ref[:cut + 1], j
        assert got["finish"] == "stop"  # the first token too (min_tokens 1)


def test_eos_without_ignore_eos(engines):
    spec, plain = engines
    compare(spec, plain, SpeculationConfig().drafter, max_tokens=N_NEW, ignore_eos=False)


@pytest.mark.parametrize("cancel_after", [1, 2, 5, 6, 11, 20])
def test_cancel_mid_stream(engines, cancel_after):
    spec, plain = engines
    ref = reference(plain)
    got = compare(spec, plain, lambda: OracleDrafter(len(PROMPT), ref, mixed_plan, spec.vocab_size),
                  max_tokens=N_NEW, cancel_after=cancel_after)
    assert got["finish"] == "abort"
    # The stream stops between steps: at most one verify's tokens past the cancel.
    assert cancel_after <= len(got["tokens"]) <= cancel_after + 4


def test_the_rows_a_stream_left_behind_do_not_leak(engines):
    """A request that stopped with a step queued (its rows past the live length) followed by one whose rows
    overlap: the second request's tokens are the reference."""
    spec, plain = engines
    ref = reference(plain)
    with drafter(spec, lambda: OracleDrafter(len(PROMPT), ref, mixed_plan, spec.vocab_size), []):
        run(spec, PROMPT + PROMPT[::-1], max_tokens=7)
        assert run(spec, PROMPT, max_tokens=N_NEW)["tokens"] == ref


def test_counters_on_the_engine(engines):
    spec, plain = engines
    ref = reference(plain)
    before = spec.spec_stats.as_dict()
    got = compare(spec, plain, lambda: OracleDrafter(len(PROMPT), ref, mixed_plan, spec.vocab_size),
                  max_tokens=N_NEW)
    after = spec.spec_stats.as_dict()
    # compare() ran the request twice on `spec` (chained and unchained) with the same counters each time
    for key in ("verify_steps", "plain_steps", "drafted_tokens", "accepted_tokens"):
        assert after[key] - before[key] == 2 * got["spec"][key], key
    s = got["spec"]
    assert s["accepted_tokens"] + s["verify_steps"] + s["plain_steps"] == N_NEW - 1


# ------------------------------------------------------------------ the other GPU step kinds
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("attention,cuda_graph", [("masked", True), ("split", False)])
def test_gpu_step_kinds(hf_model, attention, cuda_graph):
    """The chain under speculation on the masked-attention graph and on the eager CUDA step (events, no
    graph), against speculation off on the eager step."""
    _, path, _ = hf_model
    spec = DecodeEngine.from_pretrained(path, device="cuda", max_seq_len=MAX_SEQ, attention=attention,
                                        cuda_graph=cuda_graph)
    plain = DecodeEngine.from_pretrained(path, device="cuda", max_seq_len=MAX_SEQ, attention="split",
                                         cuda_graph=False, speculation=None)
    assert spec.cuda_graph == cuda_graph
    ref = reference(plain)
    for plan in ("mixed", "none", "wrong_first", "single"):
        got = compare(spec, plain, lambda: OracleDrafter(len(PROMPT), ref, PLANS[plan], spec.vocab_size),
                      max_tokens=N_NEW)
        assert got["tokens"] == ref, plan
    for n in (1, 2, 5, 9, 13):
        compare(spec, plain, lambda: OracleDrafter(len(PROMPT), ref, mixed_plan, spec.vocab_size), max_tokens=n)
    compare(spec, plain, SpeculationConfig().drafter, max_tokens=N_NEW, prompt_token_ids=PROMPT + ref)
