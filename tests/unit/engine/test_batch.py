"""Several users on one engine (decode/batch.py): each user's logits at every position are `torch.equal` to the
same request served alone on the same engine, whatever the other rows are (their number, their contexts, their
speculation, their sampling, a neighbour cancelled mid-way or joining late), on the three architectures, in
float32 on a CPU and, where a GPU is, in bf16 on the lean step's graphs (Qwen3's per-head norms are not the lean
step's: such an engine refuses several seats at build). Greedy tokens therefore equal too, and seeded sampling
that does not speculate."""

from __future__ import annotations

import random

import pytest
import torch

from expresslane.engine.decode import DecodeEngine, SamplingParams, SpeculationConfig

SEATS = 4
MAX_SEQ = 256
VOCAB = 512


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def engines(request, hf_model):
    """(kind, {speculation name: a 4-seat engine}) over one random checkpoint of each architecture, on each
    device (a GPU: bf16, the lean step's graphs)."""
    kind, path, _ = hf_model
    device = request.param
    dtype = "bfloat16" if device == "cuda" else "float32"
    specs = {"off": None, "adaptive": SpeculationConfig(), "always": SpeculationConfig(adaptive=False)}
    if device == "cuda" and kind == "qwen3":
        with pytest.raises(ValueError, match="seats"):
            DecodeEngine.from_pretrained(path, max_seq_len=MAX_SEQ, dtype=dtype, device=device, seats=SEATS)
        pytest.skip("Qwen3 (per-head q/k norms) is not the lean step's: one seat on a GPU (refused at build)")
    built = {}
    for name, spec in specs.items():
        engine = DecodeEngine.from_pretrained(path, max_seq_len=MAX_SEQ, speculation=spec, seats=SEATS,
                                              dtype=dtype, device=device)
        engine.warmup()
        built[name] = engine
    return f"{kind}-{device}", built


def prompts(seed: int = 0) -> list[list[int]]:
    """Four prompts of different lengths; two repeat themselves, so prompt lookup drafts on them."""
    rng = random.Random(seed)
    loop = [rng.randrange(VOCAB) for _ in range(9)]
    return [[rng.randrange(VOCAB) for _ in range(17)], loop * 6, [rng.randrange(VOCAB) for _ in range(5)],
            [rng.randrange(VOCAB) for _ in range(30)] + loop * 3]


class Recorder:
    """Records, per seat, the logits of every row the engine's forwards computed, keyed by (position, the token
    ids from the prompt's end up to that row): a rejected draft's row (another context) never meets a kept one."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine, self.rows = engine, {}
        self._orig = engine.runner.forward_rows
        self.steps: list[int] = []

    def __enter__(self) -> "Recorder":
        def hook(plan, want_argmax=False, while_running=None):
            out, argmax = self._orig(plan, want_argmax, while_running)
            i = 0
            for seat, start, toks in plan:
                for j in range(len(toks)):
                    self.rows.setdefault(seat, {})[(start + j, tuple(toks[:j + 1]))] = out[i + j].clone()
                i += len(toks)
            self.steps.append(i)
            return out, argmax
        self.engine.runner.forward_rows = hook
        return self

    def __exit__(self, *exc) -> None:
        self.engine.runner.forward_rows = self._orig


def start(engine, seat, prompt, **sampling):
    first = int(engine.prefill(prompt, seat=seat).argmax())
    params = SamplingParams(**{"max_tokens": 40, "ignore_eos": True, "prompt_token_ids": prompt, **sampling})
    return engine.generate(first, len(prompt), params, seat=seat)


def run_all(engine, gens) -> None:
    while engine.scheduler.active:
        engine.scheduler.step()


def true_rows(rows: dict, gen, prompt_len: int) -> dict[int, torch.Tensor]:
    """The rows whose inputs are the request's own output: position -> logits (the row at prompt_len + i has
    input token_ids[i])."""
    out = {}
    for (pos, inputs), logits in rows.items():
        i = pos - prompt_len - len(inputs) + 1  # the first input's index in token_ids
        if i >= 0 and list(inputs) == gen.token_ids[i:i + len(inputs)]:
            out[pos] = logits
    return out


def solo(engine, seat, prompt, **sampling):
    with Recorder(engine) as rec:
        gen = start(engine, seat, prompt, **sampling)
        run_all(engine, [gen])
    return gen, true_rows(rec.rows.get(seat, {}), gen, len(prompt))


def assert_same(alone, together, label: str) -> None:
    (ga, ra), (gb, rb) = alone, together
    assert ga.token_ids == gb.token_ids, label
    common = set(ra) & set(rb)
    assert len(common) >= len(ga.token_ids) - 2, f"{label}: rows compared {len(common)} of {len(ga.token_ids)}"
    bad = sorted(p for p in common if not torch.equal(ra[p], rb[p]))
    assert not bad, f"{label}: logits differ at positions {bad[:5]}"


@pytest.mark.parametrize("spec", ["off", "adaptive", "always"])
def test_four_users_each_bit_identical_to_alone(engines, spec):
    kind, by_spec = engines
    engine = by_spec[spec]
    ps = prompts()
    alone = [solo(engine, 0, p) for p in ps]
    seats = [2, 0, 3, 1]  # other seats than alone, in another order
    with Recorder(engine) as rec:
        gens = [start(engine, s, p) for s, p in zip(seats, ps)]
        run_all(engine, gens)
    assert max(rec.steps) > 1  # the users did share forwards
    for u, (s, p, g) in enumerate(zip(seats, ps, gens)):
        assert_same(alone[u], (g, true_rows(rec.rows[s], g, len(p))), f"{kind} spec={spec} user {u}")
    if spec == "always":
        assert sum(g.spec.verify_steps for g in gens) > 0  # drafts were verified among the others' rows


def test_neighbours_sampling_logprobs_penalties_do_not_touch_a_greedy_user(engines):
    kind, by_spec = engines
    engine = by_spec["always"]
    ps = prompts(1)
    alone = solo(engine, 3, ps[0])
    with Recorder(engine) as rec:
        me = start(engine, 0, ps[0])
        start(engine, 1, ps[1], temperature=1.0, top_p=0.9, seed=3)
        start(engine, 2, ps[2], logprobs=3, presence_penalty=0.5)
        start(engine, 3, ps[3], temperature=0.7, top_k=5, seed=1, max_tokens=7)  # leaves early
        run_all(engine, [])
    assert_same(alone, (me, true_rows(rec.rows[0], me, len(ps[0]))), f"{kind} greedy beside samplers")


def test_seeded_sampling_without_speculation_is_the_same_beside_others(engines):
    _, by_spec = engines
    engine = by_spec["always"]
    ps = prompts(2)
    sampled = dict(temperature=1.0, top_p=0.95, seed=11, repetition_penalty=1.1)  # penalties: no speculation
    alone, _ = solo(engine, 1, ps[1], **sampled)
    gens = [start(engine, s, p, **(sampled if s == 1 else {})) for s, p in enumerate(ps)]
    run_all(engine, gens)
    assert gens[1].token_ids == alone.token_ids


def test_a_neighbour_cancelled_mid_way_and_one_joining_late(engines):
    kind, by_spec = engines
    engine = by_spec["adaptive"]
    ps = prompts(3)
    alone = [solo(engine, 0, p) for p in ps[:3]]
    with Recorder(engine) as rec:
        a = start(engine, 0, ps[0])
        b = start(engine, 1, ps[1])
        for _ in range(5):
            engine.scheduler.step()
        b.cancel()
        engine.scheduler.step()
        assert b.done and b.finish_reason == "abort" and len(b.token_ids) < 40
        c = start(engine, 1, ps[2])  # joins the seat the cancelled one left, while `a` decodes
        run_all(engine, [a, c])
    assert_same(alone[0], (a, true_rows(rec.rows[0], a, len(ps[0]))), f"{kind} beside a cancel")
    assert_same(alone[2], (c, true_rows(rec.rows[1], c, len(ps[2]))), f"{kind} joined late into a freed seat")


def _compiles() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"], counters["stats"]["unique_graphs"]


def test_the_compiled_cpu_step_is_bit_identical_to_alone_and_compiles_at_warmup_only(hf_model):
    """The CPU node compiles its step by default (EXPRESS_COMPILE=1): one graph for one row, one for several
    rows of one sequence, one for rows of several (sizes symbolic, the per-sequence attention one opaque op). Each
    user's logits are still its alone bits, and nothing compiles after warmup (a recompile mid-stream is a gap
    of seconds on 2 CPUs)."""
    kind, path, _ = hf_model
    with torch._dynamo.config.patch(recompile_limit=64):  # several engines compile in this process
        engine = DecodeEngine.from_pretrained(path, max_seq_len=MAX_SEQ, seats=SEATS, compile=True,
                                              speculation=SpeculationConfig(adaptive=False))
        engine.warmup()
        ps = prompts(6)
        alone = [solo(engine, 0, p) for p in ps]
        before = _compiles()
        with Recorder(engine) as rec:
            gens = [start(engine, s, p) for s, p in zip([1, 3, 0, 2], ps)]
            run_all(engine, gens)
    assert _compiles() == before, "the compiled step compiled mid-stream"
    assert max(rec.steps) > 1
    for u, (s, p, g) in enumerate(zip([1, 3, 0, 2], ps, gens)):
        assert_same(alone[u], (g, true_rows(rec.rows[s], g, len(p))), f"{kind} compiled, user {u}")


def test_steps_are_bounded_by_max_step_rows(engines):
    _, by_spec = engines
    engine = by_spec["always"]
    ps = prompts(4)
    alone = [solo(engine, 0, p)[0].token_ids for p in ps]
    before, engine.scheduler.max_step_rows = engine.scheduler.max_step_rows, 6
    try:
        with Recorder(engine) as rec:
            gens = [start(engine, s, p) for s, p in enumerate(ps)]
            run_all(engine, gens)
    finally:
        engine.scheduler.max_step_rows = before
    assert max(rec.steps) <= 6
    assert [g.token_ids for g in gens] == alone


def test_seats_are_checked(engines):
    _, by_spec = engines
    engine = by_spec["off"]
    p = prompts()[0]
    with pytest.raises(ValueError, match="name the request's seat"):
        engine.generate(1, len(p), SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.prefill(p, seat=SEATS)
    gen = start(engine, 2, p)
    with pytest.raises(ValueError, match="seat 2 is decoding"):
        engine.inject(engine.cache.k[:, :3], engine.cache.v[:, :3], 3, seat=2)
    with pytest.raises(ValueError, match="cache holds"):
        engine.generate(1, 500, SamplingParams(), seat=3)
    run_all(engine, [gen])
    assert gen.done and gen.finish_reason == "length"


def test_a_step_that_fails_fails_its_requests_and_the_engine_goes_on(engines):
    _, by_spec = engines
    engine = by_spec["off"]
    ps = prompts(5)
    gens = [start(engine, s, p) for s, p in enumerate(ps[:2])]
    orig = engine.runner.forward_rows

    def broken(plan, want_argmax=False, while_running=None):
        raise RuntimeError("device lost")
    engine.runner.forward_rows = broken
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            engine.scheduler.step()
    finally:
        engine.runner.forward_rows = orig
    assert all(g.done and g.finish_reason == "error" and "device lost" in str(g.error) for g in gens)
    with pytest.raises(RuntimeError, match="device lost"):
        list(gens[0])  # iterating a failed request raises its error
    assert engine.scheduler.active == 0
    again = start(engine, 0, ps[0])
    run_all(engine, [again])
    assert len(again.token_ids) == 40


def test_one_users_own_failure_ends_it_alone(engines):
    """A request that fails on its own rows (here its grammar matcher refuses a token, fault-injected after a few
    steps: GrammarError, as the node's engine would raise it) ends with that error; the others keep their alone
    bits and finish."""
    from expresslane.engine.decode.grammar import GrammarError

    kind, by_spec = engines
    engine = by_spec["adaptive"]
    ps = prompts(7)
    alone = solo(engine, 0, ps[0])
    bad = start(engine, 1, ps[1])
    steps = [0]

    def refuse(logits, argmax=None, _consume=engine.scheduler._runs[1][1].consume):
        steps[0] += 1
        if steps[0] > 3:
            raise GrammarError("the grammar matcher refused a token its own mask allowed")
        return _consume(logits, argmax)

    engine.scheduler._runs[1][1].consume = refuse
    with Recorder(engine) as rec:
        me = start(engine, 0, ps[0])
        other = start(engine, 2, ps[2])
        run_all(engine, [])
    assert bad.finish_reason == "error" and isinstance(bad.error, GrammarError) and len(bad.token_ids) == 4
    assert other.done and len(other.token_ids) == 40
    assert_same(alone, (me, true_rows(rec.rows[0], me, len(ps[0]))), f"{kind} beside a request that failed")


@pytest.mark.parametrize("forward_calls_back", [True, False])
def test_a_steps_tokens_go_out_while_the_next_forward_runs(engines, forward_calls_back):
    """The tokens a step settles reach their listeners (the node's streams) from inside the next forward, once it
    is under way (decode/batch.py `deliver`): the host's work for the users' streams hides under the device's
    step. Each request hears all its tokens, in order, then its end; the tokens are its tokens alone. A forward
    that does not call back (forward_calls_back=False) gets them delivered after it returns, before consume."""
    kind, by_spec = engines
    engine = by_spec["adaptive"]
    ps = prompts(11)
    alone = [solo(engine, s, p)[0].token_ids for s, p in enumerate(ps[:3])]
    orig = engine.runner.forward_rows
    in_forward = [False]
    heard: dict[int, list] = {0: [], 1: [], 2: []}

    def hook(plan, want_argmax=False, while_running=None):
        in_forward[0] = True
        try:
            return orig(plan, want_argmax, while_running if forward_calls_back else None)
        finally:
            in_forward[0] = False

    def listener(u):
        def on_token(tok, lp, top):
            heard[u].append(("token", tok, in_forward[0]))

        def on_done(gen):
            heard[u].append(("done", gen.finish_reason, in_forward[0]))
        return on_token, on_done

    engine.runner.forward_rows = hook
    try:
        gens = []
        for u, p in enumerate(ps[:3]):
            gens.append(start(engine, u, p, max_tokens=12 + 9 * u))  # they end at different steps
            gens[-1].listen(*listener(u))
        run_all(engine, gens)
    finally:
        engine.runner.forward_rows = orig
    for u, g in enumerate(gens):
        tokens = [e[1] for e in heard[u] if e[0] == "token"]
        assert tokens == g.token_ids == alone[u][:len(tokens)], f"{kind} user {u}"
        assert heard[u][-1][:2] == ("done", "length") and sum(e[0] == "done" for e in heard[u]) == 1
        # every token of a request still decoding when its tokens went out was heard inside a forward (the last
        # request's final tokens have no next forward to hide under)
        inside = [e[2] for e in heard[u][:-1]]
        if forward_calls_back:
            assert any(inside), f"{kind} user {u}: no token went out under a forward"
            if u < 2:  # users 0 and 1 end while user 2 still decodes: all their tokens went out under forwards
                assert all(inside), f"{kind} user {u}: {inside}"
        else:
            assert not any(inside)


def test_each_token_goes_out_with_its_own_logprobs(engines):
    """A step's tokens are delivered after all of them are appended (while the next forward runs): each must still
    reach its listener with its own logprob and top logprobs, also where a verify keeps several tokens a step."""
    from expresslane.engine.decode.bench import OracleDrafter

    kind, by_spec = engines
    engine = by_spec["always"]
    ps = prompts(13)
    alone = [solo(engine, u, p)[0].token_ids for u, p in enumerate(ps[:2])]
    heard: dict[int, list] = {0: [], 1: []}
    gens = []
    try:
        for u, p in enumerate(ps[:2]):  # a drafter that proposes the request's own greedy continuation: every
            engine.new_drafter = lambda n, c=alone[u]: OracleDrafter(c, 3)  # verify keeps several tokens
            g = start(engine, u, p, logprobs=2)
            g.listen(lambda tok, lp, top, u=u: heard[u].append((tok, lp, top)))
            gens.append(g)
    finally:
        del engine.new_drafter
    run_all(engine, gens)
    assert sum(g.spec.accepted_tokens for g in gens) > 10, f"{kind}: verifies kept too few drafts"
    for u, g in enumerate(gens):
        assert [h[0] for h in heard[u]] == g.token_ids, f"{kind} user {u}"
        assert [h[1] for h in heard[u]] == g.logprobs, f"{kind} user {u}: a token went out with another's logprob"
        assert [h[2] for h in heard[u]] == g.top_logprobs, f"{kind} user {u}"
        assert len({lp for lp in g.logprobs if lp is not None}) > 1
