"""StepRunner: owns how one forward of T tokens at positions start .. start+T-1 runs, and its capture.

T = 1 is a plain decode step, T = k + 1 verifies k drafts in one forward. The runner holds the step's device
buffers (token rows, the start position), picks the attention kernel, and runs the step one of four ways:

* eager: kernel by kernel from Python;
* compiled: the same step through torch.compile. Dynamo specialises a size of 1, so T = 1 is one graph and
  T = 2 .. max_rows (and, with live attention, every length) one symbolic graph; `warmup` compiles both, and
  nothing compiles mid-stream: every step feeds the compiled function the runner's own buffers (a view of
  `_tokens`, `_start`), never the caller's tensor, because dynamo also guards on a tensor's dispatch keys
  and a tensor made outside inference mode (e.g. a slice of a long-lived arange) differs from one made inside
  it: that guard failure recompiled the first verify steps of a stream (a 17 s gap at token 151 on 2 CPUs;
  tests/unit/engine/test_no_recompile.py counts dynamo's compiles after warmup);
* graph / compiled graph (CUDA, fixed-shape attention): one CUDA graph per T bucket, captured on first use
  (`capture` does it ahead of time), replayed with the start position read from a device buffer;
* lean graph (CUDA, split-KV attention, the default there): every bucket's graph holds the lean step
  (models/lean.py: 6 fused Triton kernels a layer, no torch.compile) instead of the PyTorch step: T = 1 and
  the verify buckets T = 2 .. max_rows, whose row r is bit-identical to the T = 1 step at start + r (the
  row-invariant verify), so speculation never changes a greedy token. A step never mixes the lean T = 1 step
  with the PyTorch verify: where the lean verify cannot take max_rows (k > 4) the lean step is off.
  `lean=None` picks it wherever it applies, `lean=True` demands it (ValueError saying why it does not apply),
  `lean=False` keeps the PyTorch step; `set_lean` switches later.

`greedy_step` is the T = 1 step of a greedy chain: the step reads its token and start position from the
runner's device buffers and writes the argmax of its logits and the next position back into them, so the host
can queue the next step before it has read this one's token (decode/chain.py). On the graph path that is one
more graph per runner (the T = 1 step plus the argmax and the advance; the lean step folds the argmax into its
lm_head kernel and advances in one more kernel, models/lean.py); elsewhere the same three operations run one
after the other.

The host's path around a forward is short because the engine syncs on it: a verify's rows are read back before
the next forward is known. Token ids given as a host list are staged (`_stage`: on a GPU the start position and
the rows written into a pinned slot and set with one asynchronous copy, instead of a pageable copy and two
kernels), and a verify's graph ends with its rows' argmax copied into pinned memory, which `greedy_rows` reads
after an event (the GIL released while it waits) instead of an argmax kernel and a read after the graph.

The model owns the math, the engine owns the cache; the runner owns nothing else.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch

from ..models import Transformer
from ..models.attention import AttentionKind, StepContext, causal_mask
from ..models.cpu_linear import row_linear
from .cache import StaticKVCache


GREEDY = "greedy"  # the chained T = 1 step's graph key
SEATS_KEY = "seats"  # (SEATS_KEY, rows): a step over several users' rows (forward_rows on the lean graph)
SEAT_RP = 16  # the most rows such a step takes: models/fused_dot.py's RP (checked where the lean step is built)


class StepMode(str, enum.Enum):
    EAGER = "eager"
    COMPILED = "compiled"
    GRAPH = "graph"
    COMPILED_GRAPH = "compiled-graph"
    LEAN_GRAPH = "lean-graph"  # every T: the lean step's graph (T > 1: its row-invariant verify)


class StepRunner:
    #: Pinned host slots a forward's inputs are staged in (`_stage`).
    STAGING_SLOTS = 4

    def __init__(self, model: Transformer, cache: StaticKVCache, cos: torch.Tensor, sin: torch.Tensor, *,
                 attention: AttentionKind, compile: bool, cuda_graph: bool, max_rows: int,
                 compile_mode: str | None = None, lean: bool | None = None, lean_gemv: str = "auto",
                 seat_rows: int = 0) -> None:
        if cuda_graph and attention is AttentionKind.LIVE:
            raise ValueError("a CUDA graph needs fixed-shape attention (masked or split), not live")
        self.model, self.cache, self.cos, self.sin = model, cache, cos, sin
        self.attention = attention
        self.compile = compile
        self.compile_mode = compile_mode  # torch.compile mode, e.g. "max-autotune-no-cudagraphs" (Triton GEMVs)
        self.cuda_graph = cuda_graph
        self.max_rows = max_rows  # the largest T (1 + the most drafts a step verifies)
        # A step over several users' rows (forward_rows) on the lean graph takes at most this many rows (0: the
        # runner serves one sequence there); the PyTorch step takes any number.
        self.seat_rows = seat_rows
        self.lean_gemv_choice = lean_gemv  # the lean step's GEMV family (models/lean.py: auto, cuda-core, ...)
        device = cache.geometry.device
        self.device = device
        # Made in inference mode, like every tensor a step sees: the compiled step's guards see one kind.
        with torch.inference_mode():
            self._arange = torch.arange(cache.geometry.max_seq_len, device=device)
            # A forward's inputs in one buffer, [start, rows ...], so the host sets them with one copy (`_stage`).
            self._inputs = torch.zeros(1 + max_rows, dtype=torch.long, device=device)
            self._start, self._tokens = self._inputs[:1], self._inputs[1:]
            self._rows_argmax = torch.zeros(max(max_rows, seat_rows), dtype=torch.long, device=device)
            # forward_rows on the lean graph: [tokens (seat_rows), positions (RP), cache rows (RP)] in one buffer
            self._seat_inputs = torch.zeros(3 * SEAT_RP, dtype=torch.long, device=device) if seat_rows else None
        # On a GPU the host stages a forward's inputs in pinned slots (each reused once its copy ran) and a
        # verify's graph copies its rows' argmaxes into pinned memory (`greedy_rows`).
        self._staging = self._argmax_host = None
        self._staged = 0
        if device.type == "cuda":
            self._staging = torch.zeros(self.STAGING_SLOTS, 1 + max_rows, dtype=torch.long, pin_memory=True)
            self._staging_np = self._staging.numpy()
            self._staging_done = [torch.cuda.Event() for _ in range(self.STAGING_SLOTS)]
            self._argmax_host = torch.zeros(max(max_rows, seat_rows), dtype=torch.long, pin_memory=True)
            self._argmax_np = self._argmax_host.numpy()
            self._argmax_done = torch.cuda.Event()
            if seat_rows:
                self._seat_staging = torch.zeros(self.STAGING_SLOTS, 3 * SEAT_RP, dtype=torch.long, pin_memory=True)
                self._seat_staging_np = self._seat_staging.numpy()
        # The PyTorch step's projections on a CPU: the row-invariant kernel (models/cpu_linear.py), so a verify's
        # row and a row of a step over several users are the bits of a one-row step.
        self.linear = row_linear if device.type == "cpu" else None
        self._greedy_steps = 0  # the lean greedy graph's replays: its greedy_seq, counted on the host
        self.step_tune = True  # `tune`: the lean step's block shapes re-decided by the whole step's time
        # Keyed by T, and GREEDY for the chained T = 1 step.
        self._graphs: dict[int | str, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._lean = None
        self._set_step()
        self.set_lean(lean)

    def lean_unsupported_reason(self) -> str | None:
        """Why the lean T = 1 step cannot run here (None: it can)."""
        if not self.cuda_graph or self.device.type != "cuda":
            return "the lean step runs as a CUDA graph on a CUDA device"
        if self.attention is not AttentionKind.SPLIT_KV:
            return f"the lean step uses the split-KV attention, not {self.attention.value}"
        try:  # imported here: Triton's jit must not be set up on a CPU-only host (its interpreter is a test mode)
            from ..models.lean import LeanStep
        except ImportError as e:
            return f"the lean step needs triton ({e})"
        from ..models.fused import MAX_ROWS

        if self.max_rows > MAX_ROWS:  # the T = 1 step must never be mixed with the PyTorch verify
            return (f"a verify of {self.max_rows} rows (speculation k = {self.max_rows - 1}): the lean step's "
                    f"row-invariant verify takes at most {MAX_ROWS} rows (k <= {MAX_ROWS - 1})")
        return LeanStep.unsupported_reason(self.model)

    def set_lean(self, lean: bool | None) -> None:
        """None: the lean T = 1 step wherever it applies; True: it, or ValueError; False: the PyTorch step."""
        why = self.lean_unsupported_reason()
        if lean and why:
            raise ValueError(why)
        on = why is None if lean is None else lean
        if on == (self._lean is not None):
            return
        self._graphs.clear()  # every bucket's graph holds the lean step or the PyTorch one
        if on:
            from ..models.lean import LeanStep

            self._lean = LeanStep(self.model, self.cos, self.sin, self.cache.k_layers, self.cache.v_layers,
                                  gemv=self.lean_gemv_choice, max_rows=self.max_rows, seat_rows=self.seat_rows)
        else:
            self._lean = None
        self._greedy_steps = 0  # a new lean step's greedy_seq starts at 0

    def _set_lean_option(self, what: str, setter: str, value) -> None:
        """LeanStep.<setter>(value), then the graphs are captured again (a captured graph keeps the kernels it
        was captured with). ValueError without the lean step (`what` names the option)."""
        if self._lean is None:
            raise ValueError(f"the {what} is the lean step's: no lean step here")
        getattr(self._lean, setter)(value)
        self._graphs.clear()

    def set_step_tune(self, on: bool) -> None:
        """Whether `tune` (the engine's warm-up) re-decides the lean step's block shapes by timing the whole
        step (models/step_tune.py; on by default); off, each kernel keeps the shape fastest alone."""
        self.step_tune = bool(on)

    def tune(self) -> list[dict]:
        """Pick the lean step's block shapes now (its first forward: models/fused.py times each kernel's
        candidates alone), then re-decide each by the time of the whole step's graph (models/step_tune.py).
        Writes cache rows at the current start position, which the caller treats as scratch; drops the graphs
        captured before where a shape changed. Returns what it measured (nothing without the lean step, with
        step_tune off, or where every pick was re-decided before in this process)."""
        if self._lean is None or not self.step_tune:
            return []
        from ..models import fused, step_tune

        lean, before = self._lean, set(fused.TIMED_PICKS)
        with torch.inference_mode():
            lean.forward(self._tokens[:self.max_rows], self._start)  # every kernel picks its shape
            new = [p for key, p in fused.TIMED_PICKS.items() if key not in before]
            measured = step_tune.refine(lambda r: lean.forward(self._tokens[:r], self._start), self.max_rows,
                                        new, self.device)
        if any(m["best"] != m["was"] for m in measured):
            self._graphs.clear()
        return measured

    def set_verify_attention(self, kind: str) -> None:
        """The lean step's verify attention (models/lean.py VERIFY_ATTENTION: per-row, the default, or shared)."""
        self._set_lean_option("verify attention", "set_verify_attention", kind)

    def set_lean_norm(self, where: str) -> None:
        """Where the lean step's tensor-core family runs its norms (models/lean.py LEAN_NORMS: kernel, the
        default, or tail)."""
        self._set_lean_option("norm placement", "set_norm", where)

    def set_lean_l2_prefetch(self, on: bool) -> None:
        """Whether the lean step's tensor-core projections prefetch their first weight tiles into the L2 before
        their PDL wait (models/lean.py)."""
        self._set_lean_option("L2 prefetch", "set_l2_prefetch", on)

    @property
    def verify_attention(self) -> str | None:
        return self._lean.verify_attention if self._lean is not None else None

    @property
    def lean_norm(self) -> str | None:
        return self._lean.norm if self._lean is not None else None

    @property
    def lean_l2_prefetch(self) -> bool | None:
        return self._lean.l2_prefetch if self._lean is not None else None

    @property
    def lean(self) -> bool:
        return self._lean is not None

    @property
    def lean_gemv(self) -> str | None:
        """The lean step's GEMV kernel family (models/lean.py), None without the lean step."""
        return self._lean.gemv if self._lean is not None else None

    @property
    def mode(self) -> StepMode:
        if self._lean is not None:
            return StepMode.LEAN_GRAPH
        if self.cuda_graph:
            return StepMode.COMPILED_GRAPH if self.compile else StepMode.GRAPH
        return StepMode.COMPILED if self.compile else StepMode.EAGER

    def _set_step(self) -> None:
        # The lean step's graphs do not depend on the PyTorch step (compiled or not); the others do.
        self._graphs = self._graphs if self._lean is not None else {}
        self._step = (torch.compile(self._forward, dynamic=True, mode=self.compile_mode) if self.compile
                      else self._forward)
        self._rows_step = (torch.compile(self._forward_rows, dynamic=True, mode=self.compile_mode) if self.compile
                           else self._forward_rows)

    def disable_compile(self) -> None:
        """Run the plain step from now on (e.g. torch.compile cannot build kernels on this host)."""
        self.compile = False
        self._set_step()

    def _forward(self, tokens: torch.Tensor, start: torch.Tensor, kv_len: int | None) -> torch.Tensor:
        t = tokens.shape[0]
        pos = start + self._arange[:t]
        mask = causal_mask(self._arange, start, t) if self.attention is AttentionKind.MASKED else None
        ctx = StepContext(self.attention, start, kv_len=kv_len, mask=mask, linear=self.linear)
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        return self.model(tokens, pos, cos, sin, self.cache.k_layers, self.cache.v_layers, ctx, num_logits=t)

    def _stage(self, start_pos: int, rows: Sequence[int]) -> None:
        """Set the device buffers a forward reads: the start position and its rows. On a GPU: written into a
        pinned slot and copied with one asynchronous copy (no kernel, no pageable copy, no wait for the
        device; the slot is reused only after its last copy ran); elsewhere in place."""
        t = len(rows)
        if self._staging is None:
            self._inputs[:1 + t].copy_(torch.tensor([start_pos, *rows], dtype=torch.long))
            return
        slot = self._staged % self.STAGING_SLOTS
        self._staged += 1
        done = self._staging_done[slot]
        done.synchronize()  # this slot's copy of STAGING_SLOTS forwards ago has run (at once when never recorded)
        host = self._staging_np[slot]
        host[0] = start_pos
        host[1:1 + t] = rows
        self._inputs[:1 + t].copy_(self._staging[slot, :1 + t], non_blocking=True)
        done.record()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor | Sequence[int], start_pos: int) -> torch.Tensor:
        """tokens: [T] long on the device, or T token ids on the host (staged: `_stage`), at positions
        start_pos .. start_pos+T-1 (their K/V are written there). Returns float32 logits [T, vocab]; on the
        graph path they live in the graph's output buffer until the next forward with the same T."""
        t = len(tokens)
        if not 1 <= t <= self.max_rows:
            raise ValueError(f"a step takes 1..{self.max_rows} tokens, got {t}")
        rows = self._tokens[:t]
        if isinstance(tokens, torch.Tensor):
            self._start.fill_(start_pos)
            rows.copy_(tokens)
        else:
            self._stage(start_pos, tokens)
        if not self.cuda_graph:
            kv_len = start_pos + t if self.attention is AttentionKind.LIVE else None
            return self._step(rows, self._start, kv_len)
        if t not in self._graphs:
            self._capture(t)
        graph, logits = self._graphs[t]
        graph.replay()
        return logits

    def multi_seat_unsupported(self) -> str | None:
        """Why this runner cannot run a step over several sequences (forward_rows), or None."""
        if self._lean is not None:
            if not self.seat_rows:
                return "the lean step was built for one sequence (seat_rows 0)"
            return None
        if self.cuda_graph or self.attention is not AttentionKind.LIVE:
            return (f"several users a step run the lean step's tensor-core GEMVs on a GPU, or the live-attention "
                    f"PyTorch step; this runner runs {self.mode.value} with {self.attention.value} attention")
        return None

    @torch.inference_mode()
    def forward_rows(self, plan: Sequence[tuple[int, int, Sequence[int]]], want_argmax: bool = False,
                     while_running: Callable[[], None] | None = None) -> tuple[torch.Tensor, list[int] | None]:
        """One forward over the rows of several sequences: plan holds (seat, start position, token ids) per
        sequence, its tokens at positions start .. in its seat of the cache (decode/cache.py). Returns float32
        logits [rows, vocab] in plan order (on the graph path: the graph's buffer, until its next replay) and,
        with want_argmax, every row's argmax (read with the step's one host sync). `while_running()` is called
        once the forward is enqueued on the device and before the host waits for it (on a CPU, which computes
        it on this thread, before it): the caller's host work overlaps the device's step. Each sequence's rows are the
        bits a step of it alone computes here: a CPU runs the PyTorch step with the live attention per sequence
        and the row-invariant projections (models/cpu_linear.py); a GPU the lean step's forward_seats (tensor-core
        GEMVs, each row's attention over its own seat), one CUDA graph per row count."""
        why = self.multi_seat_unsupported()
        if why:
            raise ValueError(why)
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        groups = []
        for seat, start, toks in plan:
            s0 = self.cache.seat_start(seat)
            groups.append((len(tokens), len(toks), s0, start + len(toks)))
            tokens += toks
            positions += range(start, start + len(toks))
            rows += range(s0 + start, s0 + start + len(toks))
        if self._lean is not None:
            return self._seats_graph(tokens, positions, rows, want_argmax, while_running)
        device = self.device
        if while_running is not None and device.type == "cpu":
            while_running()
        logits = self._rows_step(torch.tensor(tokens, dtype=torch.long, device=device),
                                 torch.tensor(positions, dtype=torch.long, device=device),
                                 torch.tensor(rows, dtype=torch.long, device=device),
                                 torch.tensor(groups, dtype=torch.long))
        if while_running is not None and device.type != "cpu":
            while_running()
        return logits, (logits.argmax(dim=-1).tolist() if want_argmax else None)

    def _forward_rows(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                      groups: torch.Tensor) -> torch.Tensor:
        """The PyTorch step over several sequences' rows (forward_rows): RoPE at each row's position, K/V into each
        row's cache row, attention per sequence (models/attention.py seat_attention). Compiled where the runner
        compiles (`_rows_step`): one graph for one row, one for several (their sizes symbolic), warmed by
        `warm_rows`."""
        ctx = StepContext(AttentionKind.LIVE, positions[:1], groups=groups, linear=self.linear)
        return self.model(tokens, rows, self.cos.index_select(0, positions), self.sin.index_select(0, positions),
                          self.cache.k_layers, self.cache.v_layers, ctx, num_logits=tokens.shape[0])

    def warm_rows(self) -> None:
        """Run forward_rows once for each shape class a step over several users takes (one row of one sequence,
        several rows of one, rows of several), so a compiled step compiles them all now and never mid-stream.
        Writes cache rows at positions 0 .. 2 of seats 0 and 1, which the caller treats as scratch."""
        seats = min(2, self.cache.seats)
        for plan in ([(0, 0, [0])], [(0, 0, [0, 1])], [(s, 0, [0, 1]) for s in range(seats)],
                     [(s, 0, [0, 1, 2][:2 + s]) for s in range(seats)]):
            self.forward_rows(plan)

    def _seats_graph(self, tokens: list[int], positions: list[int], rows: list[int], want_argmax: bool,
                     while_running: Callable[[], None] | None = None) -> tuple[torch.Tensor, list[int] | None]:
        """forward_rows on the lean graph: the inputs staged in a pinned slot and copied with one asynchronous
        copy, the row count's graph replayed (captured on first use), the rows' argmaxes read from pinned memory
        after an event (the graph copies them there)."""
        r = len(tokens)
        if r > self.seat_rows:
            raise ValueError(f"a step of {r} rows: this runner's step over several users takes {self.seat_rows}")
        slot = self._staged % self.STAGING_SLOTS
        self._staged += 1
        done = self._staging_done[slot]
        done.synchronize()
        host = self._seat_staging_np[slot]
        host[:r] = tokens
        host[SEAT_RP:SEAT_RP + r] = positions
        host[2 * SEAT_RP:2 * SEAT_RP + r] = rows
        self._seat_inputs.copy_(self._seat_staging[slot], non_blocking=True)
        done.record()
        key = (SEATS_KEY, r)
        if key not in self._graphs:
            self._capture_seats(r)
        graph, logits = self._graphs[key]
        graph.replay()
        if while_running is not None:
            while_running()
        if not want_argmax:
            return logits, None
        self._argmax_done.record()
        self._argmax_done.synchronize()
        return logits, self._argmax_np[:r].tolist()

    def _capture_seats(self, r: int) -> None:
        """The graph of a step over r rows of several sequences. Its warm-up runs compute the step at the inputs
        staged for the step about to run, so the cache rows they write are that step's own (as _capture's)."""
        lean, tokens, seat_rows = self._lean, self._seat_inputs[:r], self._seat_inputs[SEAT_RP:]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                lean.forward_seats(tokens, seat_rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = lean.forward_seats(tokens, seat_rows)
            torch.argmax(logits, dim=-1, out=self._rows_argmax[:r])
            self._argmax_host[:r].copy_(self._rows_argmax[:r], non_blocking=True)
        self._graphs[(SEATS_KEY, r)] = (graph, logits)

    def capture_seats(self) -> None:
        """Capture every row count's graph of a step over several users now (no-op without the lean step's
        seats). Writes cache rows at the staged inputs' rows, which the caller treats as scratch."""
        if self._lean is None or not self.seat_rows:
            return
        with torch.inference_mode():
            for r in range(1, self.seat_rows + 1):
                if (SEATS_KEY, r) not in self._graphs:
                    self._seat_inputs.zero_()
                    self._capture_seats(r)

    @torch.inference_mode()
    def greedy_rows(self, rows: Sequence[int], start_pos: int) -> list[int]:
        """One forward of `rows` (host token ids) at start_pos ..: each row's argmax, the greedy verify's
        targets (the host waits for them). A verify's graph (T > 1) ends with that argmax and its copy into
        pinned host memory, so the host waits on an event (the GIL released) and reads them in place; elsewhere
        the same argmax runs after the forward."""
        logits = self.forward(rows, start_pos)
        t = len(rows)
        if self.cuda_graph and t > 1:
            self._argmax_done.record()
            self._argmax_done.synchronize()
            return self._argmax_np[:t].tolist()
        return logits.argmax(dim=-1).tolist()

    @torch.inference_mode()
    def start_greedy(self, token: int, start_pos: int) -> tuple[torch.Tensor, int] | None:
        """Set the device buffers a greedy chain starts from (`token` at position `start_pos`) and return the
        lean step's (token ring, step count) where the greedy step writes each token itself (models/lean.py's
        token_ring and greedy_seq, which the host counts too: every greedy_step replays the greedy graph once,
        and a capture's warm-ups leave the count as it was), or None (read the token buffer).

        The lean greedy graph is captured here when it is not yet, and only AFTER the buffers are set: a
        capture's warm-up runs compute the step at the runner's buffers and write its K/V row at their start
        position, so with the buffers set they write exactly the row the chain's first step writes. Captured
        before (as it once was, from the ring's accessor), the warm-ups ran at the last forward's start and
        token and overwrote a live cache row: on a fresh engine, row 0 of the first request's prompt, which
        then decoded wrong tokens from its second token on (H200, 2026-12-04; tests/unit/engine/
        test_first_request.py). No capture then runs between the caller's read of the count and its reads."""
        self._stage(start_pos, (token,))
        if self._lean is None or not self.cuda_graph or self.device.type != "cuda":
            return None
        if GREEDY not in self._graphs:
            self._capture(1, greedy=True)
        return self._lean.token_ring, self._greedy_steps

    @torch.inference_mode()
    def greedy_step(self, start_pos: int) -> torch.Tensor:
        """One T = 1 step on the runner's own token and start buffers (start_greedy, or the previous
        greedy_step): writes the K/V of the token at the start position, then the argmax of the step's float32
        logits (what Sampler.sample returns for greedy) into the token buffer and start + 1 into the start
        buffer, all on the device. `start_pos` is the host's count of the same position (the live-length
        attention of the eager CPU step needs it; graphs ignore it). Returns the token buffer [1], which the
        next greedy_step overwrites: copy it out (decode/chain.py) before then, in stream order."""
        tokens = self._tokens[:1]
        if self.cuda_graph:
            if GREEDY not in self._graphs:
                self._capture(1, greedy=True)
            self._graphs[GREEDY][0].replay()
            self._greedy_steps += self._lean is not None  # the lean greedy graph counts itself (greedy_seq)
            return tokens
        kv_len = start_pos + 1 if self.attention is AttentionKind.LIVE else None
        self._advance(self._step(tokens, self._start, kv_len))
        return tokens

    def _advance(self, logits: torch.Tensor) -> None:
        self._tokens[:1].copy_(logits[-1].argmax(dim=-1, keepdim=True))
        self._start.add_(1)

    def capture(self, rows: range | None = None) -> None:
        """Capture the CUDA graph of each T bucket now (no-op off the graph path), and the greedy chain's when
        `rows` is None. Writes cache rows at the current start position, which the caller treats as scratch."""
        if self.cuda_graph:
            for t in rows or range(1, self.max_rows + 1):
                if t not in self._graphs:
                    with torch.inference_mode():
                        self._capture(t)
            if rows is None and GREEDY not in self._graphs:
                with torch.inference_mode():
                    self._capture(1, greedy=True)

    def _capture(self, t: int, greedy: bool = False) -> None:
        # Warm-up runs on a side stream first (cuBLAS workspaces, torch.compile, Triton autotune), as capture
        # requires. They compute the same step for the same tokens and start, so the cache rows they write are
        # the ones the step writes anyway.
        # The lean step's first warm-up run also picks its kernels' block shapes (models/fused.py).
        tokens = self._tokens[:t]
        lean = self._lean
        step = (lambda tok, start, kv_len: lean.forward(tok, start)) if lean is not None else self._step
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                step(tokens, self._start, None)
            if greedy and lean is not None:  # its argmax kernels, compiled before the capture
                lean.warm_greedy(tokens, self._start)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            # Recorded, not run: the warm-ups above left the buffers as they were.
            if greedy and lean is not None:  # the lean step folds the argmax into its lm_head kernel
                logits = lean.forward(tokens, self._start, greedy=True)
            else:
                logits = step(tokens, self._start, None)
                if greedy:
                    self._advance(logits)
                elif t > 1:  # a verify: its rows' argmaxes into pinned host memory (greedy_rows)
                    torch.argmax(logits, dim=-1, out=self._rows_argmax[:t])
                    self._argmax_host[:t].copy_(self._rows_argmax[:t], non_blocking=True)
        self._graphs[GREEDY if greedy else t] = (graph, logits)
