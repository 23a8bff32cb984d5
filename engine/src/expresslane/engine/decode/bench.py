"""Batch-1 decode micro benchmark: tokens/s against the bandwidth bound, with and without speculation.

    python -m expresslane.engine.decode.bench {--model DIR | --random-shape llama-8b} [--dtype float32] [--device cpu]
        [--prompt-len 128]
        [--contexts 1024,8192] [--tokens 256] [--attention live|masked|split] [--compile]
        [--cuda-graph auto|on|off] [--lean auto|on|off] [--speculation-k K] [--oracle-k 1,2,3,4] [--lookup]
        [--replay TRACES.json] [--replay-text TEXTS.json] [--threads N] [--json F]

For each context (prompt length) it prints tok/s of plain decoding and, with --oracle-k, of speculative
decoding with an oracle drafter: the model's own greedy continuation (decoded first without speculation)
cut at k tokens a step, so acceptance is what the verify forward agrees with (k when logits are exact; less
where half-precision near-ties flip between a 1-row and a (k+1)-row forward). "bound" is a device copy's
bytes/s (read + write, counted as docs/performance.md's method does) over the bytes one token must read: weights plus the
live K/V at the mean context of the run. Speculative tok/s may exceed it: that is the point.

--replay runs recorded speculation traces at this model's speed: a trace is the (drafted, kept) of every step of
a real request's drafter (`RecordingDrafter`; docs/bench/2026-12-04-copy-acceptance/make_copy_model.py --trace records the node's prompt
lookup on the repo's copy-and-continue model over code-edit and agentic prompts), and `ReplayDrafter` proposes
the same number of drafts a step, the first `kept` of them the model's own greedy continuation and the next
one wrong. So a large model verifies exactly the row counts, and keeps exactly the drafts, that the real
drafter's request did, on text it cannot be trained to copy here (no checkpoint is downloaded).
--replay-text runs the node's own drafter, with this engine's measured step costs, on recorded text (a prompt and
the greedy output of the model it was recorded with: docs/bench/2026-12-04-copy-acceptance/make_copy_model.py --texts): `TextReplayDrafter`
plays the recorded request out under the drafter and has this model verify the row counts the drafter's policy
picks there, keeping what it earned. A trace fixes the row counts; a text lets the policy choose them here.
--lean-gemv per-request: an engine with a runner of each GEMV family that runs each request on the family its
prompt suits (decode/family.py). A row's `family` says which one ran and why: the plain, lookup and oracle rows
carry the random prompt (or none), a text row its recorded prompt, as the node would receive them;
`step_ms_by_rows_by_family` has each family's forwards.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from .engine import ATTENTION_MODES, CUDA_GRAPH_CHOICES, PER_REQUEST, DecodeEngine
from .sampling import SamplingParams
from .shapes import SHAPES, random_checkpoint
from .speculative import SpeculationConfig, StepCosts, kept_drafts


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read + written."""
    if device.type != "cuda":
        nbytes, reps = 256 << 20, 5
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    return 2 * nbytes * reps / (time.perf_counter() - t0)


class OracleDrafter:
    """Proposes the known greedy continuation, at most `k` tokens a step (the acceptance sweep's drafter)."""

    def __init__(self, continuation: list[int], k: int) -> None:
        self.continuation, self.k = continuation, k
        self.i = 1

    def start(self, context) -> None:
        self.i = 1  # continuation[0] is the first token, already emitted

    def propose(self, k: int) -> list[int]:
        return self.continuation[self.i:self.i + min(k, self.k)]

    def extend(self, tokens) -> None:
        self.i += len(tokens)


class RecordingDrafter:
    """Another drafter, recorded: `steps` gets (drafted, kept) for every step of the request (the engine calls
    propose, then extend with the kept drafts and the target's token)."""

    def __init__(self, inner, steps: list[tuple[int, int]]) -> None:
        self.inner, self.steps = inner, steps
        self._drafted = 0

    def start(self, context) -> None:
        self.steps.clear()
        self.inner.start(context)

    def may_draft_next(self) -> bool:
        may = getattr(self.inner, "may_draft_next", None)
        return may is None or may()

    def propose(self, k: int) -> list[int]:
        drafts = self.inner.propose(k)
        self._drafted = len(drafts)
        return drafts

    def extend(self, tokens) -> None:
        self.steps.append((self._drafted, len(tokens) - 1 if self._drafted else 0))
        self._drafted = 0
        self.inner.extend(tokens)


class ReplayDrafter:
    """Replays a recorded trace of (drafted, kept) steps (from the start again when it runs out) against a known
    greedy continuation: each step proposes `drafted` tokens (at most what the engine allows) of which the first
    `kept` are the continuation and the next one is not, so an exact verify keeps exactly `kept`."""

    def __init__(self, continuation: list[int], trace: list[tuple[int, int]], vocab_size: int) -> None:
        if not trace or any(not 0 <= a <= d for d, a in trace):
            raise ValueError("a trace is a non-empty list of (drafted, kept) with 0 <= kept <= drafted")
        self.continuation, self.trace, self.vocab = continuation, trace, vocab_size
        self.i, self.step = 1, 0

    def start(self, context) -> None:
        self.i, self.step = 1, 0  # continuation[0] is the first token, already emitted

    def may_draft_next(self) -> bool:
        return self.trace[(self.step + 1) % len(self.trace)][0] > 0

    def propose(self, k: int) -> list[int]:
        drafted, kept = self.trace[self.step % len(self.trace)]
        drafted = min(drafted, k, len(self.continuation) - self.i)
        kept = min(kept, drafted)
        drafts = self.continuation[self.i:self.i + kept]
        if drafted > kept:  # a wrong token where the target's own goes, then anything (never verified)
            drafts.append((self.continuation[self.i + kept] + 1) % self.vocab)
            drafts += self.continuation[self.i + kept + 1:self.i + drafted]
        return drafts

    def extend(self, tokens) -> None:
        self.i += len(tokens)
        self.step += 1


class TextReplayDrafter:
    """A drafter run on a recorded request's text, its drafts translated to this model. The recorded request
    (a prompt and its greedy output on the model it was recorded with: docs/bench/2026-12-04-copy-acceptance/make_copy_model.py --texts)
    plays out step by step under `inner` (the node's own drafter, given this engine's step costs); where it
    proposes d drafts of which the first `kept` are the recorded output's next tokens, this drafter proposes d
    tokens of which the first `kept` are this model's greedy continuation and the next one is not. So this
    model verifies the row counts the drafter's policy picks on that text at this engine's costs, and keeps
    what the drafter would have earned there. Past the recorded output it proposes nothing."""

    def __init__(self, inner, prompt: list[int], output: list[int], continuation: list[int], vocab_size: int) -> None:
        if not output:
            raise ValueError("a recorded text needs at least one output token")
        self.inner, self.prompt, self.output = inner, prompt, output
        self.continuation, self.vocab = continuation, vocab_size
        self.i = 1

    def start(self, context) -> None:
        self.i = 1  # output[0] / continuation[0]: the first token, already emitted
        self.inner.start([*self.prompt, self.output[0]])

    def may_draft_next(self) -> bool:
        may = getattr(self.inner, "may_draft_next", None)
        return self.i < len(self.output) - 1 and (may is None or may())

    def propose(self, k: int) -> list[int]:
        k = min(k, len(self.output) - self.i, len(self.continuation) - self.i)
        if k <= 0:
            return []
        drafts = self.inner.propose(k)[:k]
        kept = 0
        while kept < len(drafts) and drafts[kept] == self.output[self.i + kept]:
            kept += 1
        out = self.continuation[self.i:self.i + kept]
        if kept < len(drafts):
            out.append((self.continuation[self.i + kept] + 1) % self.vocab)
            out += self.continuation[self.i + kept + 1:self.i + len(drafts)]
        return out

    def extend(self, tokens) -> None:
        n = min(len(tokens), len(self.output) - self.i)
        if n > 0:
            self.inner.extend(self.output[self.i:self.i + n])
        self.i += len(tokens)


def simulate_speedup(drafter, prompt: list[int], output: list[int], costs: StepCosts, k: int,
                     verify_overhead: float = 0.0, start: int | None = None,
                     tally: dict[str, int] | None = None, sync_overhead: float = 0.0,
                     verify_queues_ahead: bool = False) -> float:
    """Plain decoding's time over speculative decoding's for a recorded greedy request (prompt, output), with
    `drafter` and step `costs` (at the row's position), without a model: the output is fixed, so a draft is
    kept exactly where it matches it. verify_overhead: added to each verify's cost (what a host wait costs
    beyond the costs' own; the engine's measured costs already hold it). start: the position of the output's
    first token (default: the prompt's length). The engine's loop, step for step.

    Forwards are told apart by how the greedy chain (decode/chain.py) launches them: `verify`, `synced` (a plain
    step after a host sync: after a verify, or where the drafter's hint said it might draft) and `queued` (a
    plain step queued ahead of the host). tally: filled with their counts. sync_overhead: added to every
    forward launched after a host sync (verifies and synced plain steps; the plain baseline's steps are all
    queued). verify_queues_ahead: the step after a verify is queued ahead where the drafter's hint, asked once
    the verify's tokens are known, says it cannot draft next (the most a verify that advanced the chain on
    the device could give: the engine would have to decide before it reads the verify)."""
    drafter.start([*prompt, output[0]])
    pos, i, spec, plain = len(prompt) if start is None else start, 1, 0.0, 0.0
    synced = True
    if tally is not None:
        tally.update(verify=0, synced=0, queued=0)
    while i < len(output):
        room = len(output) - i - 1
        drafts = drafter.propose(min(k, room)) if room > 0 else []
        kept = kept_drafts(drafts, output, i)
        step = costs.at(pos, len(drafts) + 1)
        spec += step[len(drafts)] + (verify_overhead if drafts else 0.0) + (sync_overhead if drafts or synced
                                                                            else 0.0)
        emitted = output[i:i + kept + 1]
        plain += sum(costs.at(pos + j, 1)[0] for j in range(len(emitted)))
        if tally is not None:
            tally["verify" if drafts else "synced" if synced else "queued"] += 1
        hint = getattr(drafter, "may_draft_next", None)  # asked after a plain step, before its extend
        synced = bool(drafts) or hint is None or bool(hint())
        drafter.extend(emitted)
        if drafts and verify_queues_ahead:
            synced = hint is None or bool(hint())
        i += len(emitted)
        pos += len(emitted)
    return plain / spec if spec else 1.0


def load_texts(path: str) -> dict[str, tuple[list[int], list[int]]]:
    """{name: (prompt, output)} from a JSON file of {"texts": {name: {"prompt": [...], "output": [...]}}}."""
    with open(path) as f:
        data = json.load(f)
    texts = data.get("texts") if isinstance(data, dict) else None
    if not isinstance(texts, dict) or not texts:
        raise ValueError(f"{path}: no 'texts' object of name -> {{prompt: [ids], output: [ids]}}")
    out = {}
    for name, t in texts.items():
        if not isinstance(t, dict) or not t.get("output") or not isinstance(t.get("prompt"), list):
            raise ValueError(f"{path}: text {name!r} needs a 'prompt' list and a non-empty 'output' list")
        out[name] = ([int(x) for x in t["prompt"]], [int(x) for x in t["output"]])
    return out


def load_traces(path: str) -> dict[str, list[tuple[int, int]]]:
    """{name: [(drafted, kept), ...]} from a JSON file of {"traces": {name: [[d, a], ...]}}."""
    with open(path) as f:
        data = json.load(f)
    traces = data.get("traces") if isinstance(data, dict) else None
    if not isinstance(traces, dict) or not traces:
        raise ValueError(f"{path}: no 'traces' object of name -> [[drafted, kept], ...]")
    return {name: [(int(d), int(a)) for d, a in steps] for name, steps in traces.items()}


def build_engine(model: str | None, random_shape: str | None, **options) -> DecodeEngine:
    """The bench's engine: a checkpoint directory's, or random weights of a real model's shape in memory
    (decode/shapes.py); options as DecodeEngine.from_pretrained's."""
    if random_shape:
        config, tensors = random_checkpoint(random_shape, options.get("device", "cpu"))
        return DecodeEngine.from_checkpoint_tensors(config, tensors, **options)
    return DecodeEngine.from_pretrained(model, **options)


def _sync(engine: DecodeEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def time_decode(engine: DecodeEngine, prompt: list[int], first: int, tokens: int, repeats: int,
                speculative: bool, lookup_prompt: bool = False, request_prompt: list[int] | None = None) -> dict:
    """Best of `repeats` decodes of `tokens` tokens after a prefill of `prompt` (best-of: shared hosts are
    noisy). The first token is the prefill's; only decode steps are timed. request_prompt: the prompt ids the
    request carries instead (a recorded text's, whose family a per-request engine chooses from it)."""
    best, runs = None, []
    ids = request_prompt if request_prompt is not None else prompt if lookup_prompt else ()
    for _ in range(repeats):
        engine.prefill(prompt)
        _sync(engine)
        gen = engine.generate(first, len(prompt), SamplingParams(
            max_tokens=tokens + 1, ignore_eos=True, speculative=speculative,
            prompt_token_ids=ids))  # the drafter's context, as the node passes it
        next(gen)
        t0 = time.perf_counter()
        out = [t for t in gen]
        dt = time.perf_counter() - t0
        runs.append(len(out) / dt)
        if best is None or runs[-1] > best[0]:
            best = (runs[-1], gen.spec.as_dict(), gen.token_ids, gen.family)
    runs.sort()
    return {"tok_per_s": best[0], "median_tok_per_s": runs[len(runs) // 2], "spec": best[1],
            "token_ids": best[2], **({"family": best[3].as_dict()} if best[3] is not None else {})}


def family_continuation(engine: DecodeEngine, prompt: list[int], first: int, tokens: int, plain: dict,
                        request_prompt: list[int], decoded: dict[str, list[int]]) -> list[int]:
    """The greedy continuation of `prompt` a request carrying `request_prompt` decodes to: the plain row's, or
    on a per-request engine that runs it on another GEMV family, that family's own plain decode (pinned). In
    bf16 two families' reductions differ, so on a random prompt their greedy tokens part at the first near-tie:
    a replay that drafted one family's continuation for the other would be rejected from there on, and its row
    would measure the bench, not the drafter (the first per-request run on the H200 did: acceptance 0.00).
    `decoded`: the other families' continuations decoded so far (each decoded once a context)."""
    if not engine.families:
        return plain["token_ids"]
    family = engine.choose_family(request_prompt).family
    if family == plain["family"]["family"]:
        return plain["token_ids"]
    if family not in decoded:
        pinned = engine.pinned_family
        engine.pinned_family = family
        try:
            decoded[family] = time_decode(engine, prompt, first, tokens, 1, speculative=False)["token_ids"]
        finally:
            engine.pinned_family = pinned
    return decoded[family]


def step_times(engine: DecodeEngine, start: int, reps: int = 50) -> dict[int, float]:
    """Seconds per forward of T = 1 .. max_rows rows at `start` (graph replay where the engine uses graphs):
    what a verify step costs against a plain step, whatever the acceptance."""
    out = {}
    for t in range(1, engine.runner.max_rows + 1):
        rows = torch.arange(t, device=engine.device)
        for _ in range(3):
            engine.runner.forward(rows, start)
        _sync(engine)
        t0 = time.perf_counter()
        for _ in range(reps):
            engine.runner.forward(rows, start)
        _sync(engine)
        out[t] = (time.perf_counter() - t0) / reps
    return out


def bench_context(engine: DecodeEngine, prompt_len: int, tokens: int, repeats: int, oracle_ks: list[int],
                  bandwidth: float | None, seed: int = 0, lookup: bool = False,
                  traces: dict[str, list[tuple[int, int]]] | None = None,
                  texts: dict[str, tuple[list[int], list[int]]] | None = None) -> list[dict]:
    gen_ = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.vocab_size, (prompt_len,), generator=gen_).tolist()
    first = int(engine.prefill(prompt).argmax())
    wbytes = engine.weight_bytes()
    kv_bytes = engine.geometry.token_bytes() * (prompt_len + tokens / 2)
    bound = bandwidth / (wbytes + kv_bytes) if bandwidth else None
    rows = []
    plain = time_decode(engine, prompt, first, tokens, repeats, speculative=False)
    rows.append({"context": prompt_len, "mode": "plain", **plain})
    saved = engine._drafter_factory
    if engine.speculation is not None and saved is None and lookup:
        # The node's own drafter (prompt lookup, adaptive) on this prompt: on text that does not repeat it must
        # cost (almost) nothing against plain decoding, and it must not change a token.
        r = time_decode(engine, prompt, first, tokens, repeats, speculative=True, lookup_prompt=True)
        r["matches_plain"] = r["token_ids"] == plain["token_ids"]
        rows.append({"context": prompt_len, "mode": "lookup", **r})
    try:
        for k in oracle_ks:
            cont = plain["token_ids"]
            engine.set_drafter(lambda c=cont, k=k: OracleDrafter(c, k))
            r = time_decode(engine, prompt, first, tokens, repeats, speculative=True)
            r["matches_plain"] = r["token_ids"] == cont
            rows.append({"context": prompt_len, "mode": f"oracle-k{k}", **r})
        for name, trace in (traces or {}).items():
            cont = plain["token_ids"]
            engine.set_drafter(lambda c=cont, t=trace: ReplayDrafter(c, t, engine.vocab_size))
            r = time_decode(engine, prompt, first, tokens, repeats, speculative=True)
            r["matches_plain"] = r["token_ids"] == cont
            rows.append({"context": prompt_len, "mode": f"replay-{name}", **r})
        decoded: dict[str, list[int]] = {}
        for name, (t_prompt, t_output) in (texts or {}).items():
            cont = family_continuation(engine, prompt, first, tokens, plain, t_prompt, decoded)
            engine.set_drafter(lambda c=cont, p=t_prompt, o=t_output: TextReplayDrafter(
                engine.speculation.drafter(engine.step_costs, prompt_len), p, o, c, engine.vocab_size))
            r = time_decode(engine, prompt, first, tokens, repeats, speculative=True, request_prompt=t_prompt)
            r["matches_plain"] = r["token_ids"] == cont
            rows.append({"context": prompt_len, "mode": f"text-{name}", **r})
    finally:
        engine._drafter_factory = saved
    engine.prefill(prompt)
    by_family = {}
    if engine.families:  # each family's forwards (the first, the default, is the rows' step_ms_by_rows)
        active = engine.family
        try:
            for family in engine.families:
                engine.use_family(family)
                by_family[family] = ({t: 1e3 * v for t, v in step_times(engine, prompt_len).items()},
                                     engine.step_costs.as_dict())
        finally:
            engine.use_family(active)
        times, costs = by_family[engine.families[0]]
    else:
        times, costs = {t: 1e3 * v for t, v in step_times(engine, prompt_len).items()}, engine.step_costs.as_dict()
    for r in rows:
        r.pop("token_ids")
        r["step_ms_by_rows"] = times
        r["step_costs"] = costs
        if by_family:
            r["step_ms_by_rows_by_family"] = {f: t for f, (t, _) in by_family.items()}
        r.update(weight_gb=wbytes / 1e9, kv_gb=kv_bytes / 1e9, bound_tok_per_s=bound,
                 of_bound=r["tok_per_s"] / bound if bound else None,
                 speedup=r["tok_per_s"] / plain["tok_per_s"])
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a Hugging Face checkpoint directory")
    source.add_argument("--random-shape", choices=sorted(SHAPES),
                        help="random bf16 weights of a real model's shape, built in memory (decode/shapes.py; "
                             "the weights scripts/gpu_make_shape_model.py writes): no checkpoint to write or read")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seq-len", type=int, default=None, help="default: the largest context + tokens + 64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--contexts", default=None, help="comma-separated prompt lengths (overrides --prompt-len)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--attention", choices=ATTENTION_MODES, default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    ap.add_argument("--cuda-graph", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--lean", choices=["auto", "on", "off"], default="auto",
                    help="the lean T = 1 step (fused Triton kernels, CUDA graph; auto: wherever it applies)")
    ap.add_argument("--lean-gemv", choices=["auto", "cuda-core", "tensor-core", PER_REQUEST], default="auto",
                    help="the lean step's GEMV kernels (models/lean.py; auto: cuda-core; tensor-core: the "
                         "cheap verify, for traffic that repeats; per-request: a runner of each, each request "
                         "on the one its prompt suits, decode/family.py)")
    ap.add_argument("--verify-attention", choices=["per-row", "shared"], default="per-row",
                    help="the lean step's verify attention (models/lean.py VERIFY_ATTENTION)")
    ap.add_argument("--lean-norm", choices=["kernel", "tail"], default="kernel",
                    help="where the tensor-core family runs its RMSNorms (models/lean.py LEAN_NORMS)")
    ap.add_argument("--lean-l2-prefetch", action="store_true",
                    help="the tensor-core projections prefetch their first weight tiles into the L2 before "
                         "their PDL wait (models/lean.py)")
    ap.add_argument("--step-tune", choices=["on", "off"], default="on",
                    help="re-decide the lean step's block shapes by the whole step's time at warm-up "
                         "(models/step_tune.py; off: each kernel's shape fastest alone)")
    ap.add_argument("--speculation-k", type=int, default=4, help="most drafts per verify step (0: off)")
    ap.add_argument("--oracle-k", default="", help="acceptance sweep: comma-separated k for the oracle drafter")
    ap.add_argument("--lookup", action="store_true",
                    help="also decode with the engine's own drafter (prompt lookup, adaptive) on the same prompt")
    ap.add_argument("--replay", default=None,
                    help="also decode with each recorded speculation trace of this JSON file (ReplayDrafter)")
    ap.add_argument("--replay-text", default=None,
                    help="also decode with the node's own drafter on each recorded text of this JSON file "
                         "(TextReplayDrafter: its policy, this engine's costs)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-bound", action="store_true", help="skip the copy-bandwidth calibration")
    ap.add_argument("--json", default=None, help="append one JSON line per result to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else [args.prompt_len]
    oracle_ks = [int(k) for k in args.oracle_k.split(",") if k]
    max_seq_len = args.max_seq_len or max(contexts) + args.tokens + 64
    if max(oracle_ks, default=0) > args.speculation_k:
        ap.error("--oracle-k values must be <= --speculation-k")
    try:
        traces = load_traces(args.replay) if args.replay else None
    except (OSError, ValueError) as e:
        ap.error(f"--replay: {e}")
    if traces and not args.speculation_k:
        ap.error("--replay needs speculation (--speculation-k >= 1)")
    try:
        texts = load_texts(args.replay_text) if args.replay_text else None
    except (OSError, ValueError) as e:
        ap.error(f"--replay-text: {e}")
    if texts and not args.speculation_k:
        ap.error("--replay-text needs speculation (--speculation-k >= 1)")
    t0 = time.perf_counter()
    options = dict(dtype=args.dtype, device=args.device, max_seq_len=max_seq_len, attention=args.attention,
                   compile=args.compile or bool(args.compile_mode), compile_mode=args.compile_mode,
                   cuda_graph=CUDA_GRAPH_CHOICES[args.cuda_graph],
                   speculation=SpeculationConfig(k=args.speculation_k) if args.speculation_k else None,
                   lean_gemv=args.lean_gemv)
    try:
        engine = build_engine(args.model, args.random_shape, **options)
        # every runner (one per GEMV family on a per-request engine); the tensor-core family's own options go
        # to its runners, and are an error where there is none
        tensor_core = [r for r in engine.runners if r.lean_gemv == "tensor-core"] or [engine.runner]
        for runner in engine.runners:
            runner.set_lean(CUDA_GRAPH_CHOICES[args.lean])
            if args.verify_attention != "per-row":
                runner.set_verify_attention(args.verify_attention)
            runner.set_step_tune(args.step_tune == "on")
        for runner in tensor_core:
            if args.lean_norm != "kernel":
                runner.set_lean_norm(args.lean_norm)
            if args.lean_l2_prefetch:
                runner.set_lean_l2_prefetch(True)
        engine.warmup()
    except (OSError, ValueError) as e:  # missing checkpoint, unsupported model, bad option combination
        ap.error(str(e))
    load_s = time.perf_counter() - t0
    gemv = PER_REQUEST if engine.families else engine.runner.lean_gemv
    bw = None if args.no_bound else copy_bandwidth(engine.device)
    model_name = args.model or args.random_shape  # the JSON's "model": a shape's name for random weights
    print(f"model={model_name} type={engine.config.model_type} dtype={args.dtype} device={args.device} "
          f"attention={engine.attention} step={engine.runner.mode.value} gemv={gemv} "
          f"verify_attention={engine.runner.verify_attention} lean_norm={engine.runner.lean_norm} "
          f"l2_prefetch={engine.runner.lean_l2_prefetch} compile_mode={args.compile_mode} threads={torch.get_num_threads()} "
          f"max_seq_len={max_seq_len} load+warmup_s={load_s:.1f} weights={engine.weight_bytes() / 1e9:.3f}GB"
          + (f" copy_bandwidth={bw / 1e9:.0f}GB/s" if bw else ""), flush=True)
    if engine.warmup_report:
        print("warmup " + json.dumps(engine.warmup_report), flush=True)
    for ctx in contexts:
        results = bench_context(engine, ctx, args.tokens, args.repeats, oracle_ks, bw, lookup=args.lookup,
                                traces=traces, texts=texts)
        times = results[0]["step_ms_by_rows"]
        t1 = times[1]
        print(f"context={ctx} forward ms by rows T: " + " ".join(f"T={t}:{v:.3f}" for t, v in times.items())
              + " | projected speedup at full acceptance (T tokens per forward): "
              + " ".join(f"k={t - 1}:{t * t1 / v:.2f}x" for t, v in times.items() if t > 1), flush=True)
        for r in results:
            s = r["spec"]
            bound = f" bound={r['bound_tok_per_s']:.0f} of_bound={100 * r['of_bound']:.1f}%" if bw else ""
            extra = (f" acceptance={s['mean_acceptance']:.2f} tok/fwd={s['tokens_per_forward']:.2f} "
                     f"exact={r.get('matches_plain')}" if r["mode"] != "plain" else "")
            extra += f" family={r['family']['family']}" if "family" in r else ""
            print(f"context={ctx} {r['mode']}: tok/s={r['tok_per_s']:.1f} (median {r['median_tok_per_s']:.1f}) "
                  f"kv={r['kv_gb']:.3f}GB{bound} speedup={r['speedup']:.2f}x{extra}", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"model": model_name, "dtype": args.dtype, "attention": engine.attention,
                                        "step": engine.runner.mode.value, "gemv": gemv,
                                        "verify_attention": engine.runner.verify_attention,
                                        "lean_norm": engine.runner.lean_norm,
                                        "l2_prefetch": engine.runner.lean_l2_prefetch,
                                        "step_tune": engine.runner.step_tune,
                                        "speculation_k": args.speculation_k, "load_warmup_s": round(load_s, 2),
                                        "warmup": engine.warmup_report, **r}) + "\n")


if __name__ == "__main__":
    main()
