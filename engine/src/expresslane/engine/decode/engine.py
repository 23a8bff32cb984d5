"""DecodeEngine: one model, one static KV cache of one or more seats, one request per seat (see the package docstring)."""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..models import ModelConfig, Transformer, load_model
from ..models.loader import model_from_tensors
from ..models.attention import ATTENTION_ALIASES, AttentionKind, StepContext
from ..models.rope import rope_tables
from .cache import KVGeometry, StaticKVCache
from .chain import ChainState, GreedyChain, greedy_accept
from .family import FAMILIES, FamilyChoice, FamilyPolicy, choose_family
from .runner import SEAT_RP, StepRunner
from . import logprobs as lp
from .batch import SeatScheduler
from .sequence import SequenceRun, finish_reason
from .grammar import BACKEND as GRAMMAR_BACKEND
from .grammar import GrammarError, RequestGrammar
from .sampling import HONOURED_SAMPLING_OPTIONS, Sampler, SamplingParams
from .speculative import Drafter, SpecStats, SpeculationConfig, StepCosts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: lean_gemv: the engine holds a runner of each GEMV family and runs each request on the one its prompt suits
#: (decode/family.py).
PER_REQUEST = "per-request"
ATTENTION_MODES = tuple(ATTENTION_ALIASES)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {list(DTYPES)}")
        return dtype
    dtype = {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {list(DTYPES)}")
    return DTYPES[dtype]


def parse_attention(attention: str | AttentionKind) -> AttentionKind:
    if isinstance(attention, AttentionKind):
        return attention
    if attention not in ATTENTION_ALIASES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    return ATTENTION_ALIASES[attention]


# --cuda-graph on the command lines (server, decode bench) -> DecodeEngine(cuda_graph=...)
CUDA_GRAPH_CHOICES = {"auto": None, "on": True, "off": False}


def multi_seat_unsupported(device_type: str, attention: str | AttentionKind, cuda_graph: bool | None,
                           lean_gemv: str = "auto", lean: bool | None = None) -> str | None:
    """Why an engine so built cannot step several users together (decode/batch.py), or None. A GPU runs them on
    the lean step with the tensor-core GEMVs (each row's bits its own, up to 16 rows: models/fused_dot.py); a CPU
    on the live-attention PyTorch step with the row-invariant linear (models/cpu_linear.py). The model's own
    limits (the lean step's) are the runner's to say (StepRunner.multi_seat_unsupported)."""
    kind = parse_attention(attention)
    graph = resolve_cuda_graph(cuda_graph, device_type, kind)
    if lean_gemv == PER_REQUEST:
        return "a per-request GEMV family runs one request at a time"
    if device_type == "cuda":
        if lean is False or not graph or kind is not AttentionKind.SPLIT_KV:
            return ("several users a step on a GPU run the lean step (split attention, CUDA graphs, --lean not off); "
                    f"this engine has attention {kind.value!r}, cuda_graph={graph}, lean={lean}")
        if lean_gemv == "cuda-core":
            return ("several users a step on a GPU run the tensor-core GEMVs (the CUDA-core kernels take 5 rows, "
                    "each row a step's compute more)")
        return None
    if graph or kind is not AttentionKind.LIVE:
        return (f"several users a step on a {device_type} run the live-attention step without CUDA graphs; this "
                f"engine has attention {kind.value!r}")
    return None


def default_attention(device_type: str) -> str:
    """On a GPU the split-KV Triton kernel (live rows only, fixed shapes: CUDA-graph friendly); elsewhere
    the live-length CPU kernel."""
    return "split" if device_type == "cuda" else "live"


def resolve_cuda_graph(cuda_graph: bool | None, device_type: str, attention: str | AttentionKind) -> bool:
    """Whether to replay decode steps as CUDA graphs. None (auto): wherever the step has fixed shapes
    (masked or split attention) and runs on a GPU. True where that does not hold is a ValueError."""
    fixed = parse_attention(attention) is not AttentionKind.LIVE
    if cuda_graph is None:
        return device_type == "cuda" and fixed
    if cuda_graph and (device_type != "cuda" or not fixed):
        raise ValueError(f"cuda_graph needs device cuda and a fixed-shape attention ('masked' or 'split'), "
                         f"got device {device_type} and attention {attention!r}")
    return cuda_graph


class Generation:
    """Iterator over token ids of one request. `finish_reason` is set when iteration ends:
    "stop" (eos / stop_token_ids, or a completed grammar), "length" (max_tokens or max_seq_len) or "abort"
    (cancelled). With `params.logprobs` set, `logprobs[i]` / `top_logprobs[i]` belong to `token_ids[i]` and are
    there when it is yielded; the first token's are None (the prefill computed them)."""

    def __init__(self, engine: "DecodeEngine", first_token_id: int, num_prompt_tokens: int,
                 params: SamplingParams, cancel_event: threading.Event | None,
                 grammar: RequestGrammar | None = None) -> None:
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.cancel_event = cancel_event or threading.Event()
        self.grammar = grammar
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        want = params.logprobs is not None
        self.logprobs: list[float | None] | None = [] if want else None
        self.top_logprobs: list[list[tuple[int, float]] | None] | None = [] if want else None
        self.spec = SpecStats()  # this request's speculation counters
        # Verify steps whose row 0 ran as the greedy chain's queued step: two forwards (decode/chain.py).
        self.split_verifies = 0
        self.family: FamilyChoice | None = None  # the GEMV family it runs and why (per-request engines)
        self.seat: int | None = None  # its seat on a multi-seat engine (decode/batch.py)
        self.error: BaseException | None = None  # why a multi-seat engine ended it ("error"), else None
        # A multi-seat engine's tokens arrive from its scheduler's steps (decode/batch.py): to a listener where
        # one is set (the node's engine thread), else into _buffer for iteration (which steps the scheduler).
        self._buffer: collections.deque[int] = collections.deque()
        self._listener = None
        self._on_done = None
        self._finished = False
        self._scheduler = None
        self._it = engine._run(self, first_token_id) if engine.scheduler is None else None

    def cancel(self) -> None:
        self.cancel_event.set()

    def listen(self, on_token, on_done=None) -> None:
        """A multi-seat engine's request: on_token(token, logprob, top_logprobs) for each token as its step emits
        it, on_done(gen) once it ends (finish_reason set; error set when it failed). Set before its first step."""
        self._listener, self._on_done = on_token, on_done

    @property
    def done(self) -> bool:
        """Its last token is out (a multi-seat engine's request; a batch-1 one is done when iteration ends)."""
        return self._finished

    def _deliver(self, token: int, index: int) -> None:
        """token_ids[index] is out (a multi-seat step delivers a step's tokens after all of them are appended:
        each one's logprobs are read at its own index)."""
        if self._listener is None:
            self._buffer.append(token)
            return
        lps = self.logprobs
        self._listener(token, lps[index] if lps is not None else None,
                       self.top_logprobs[index] if self.top_logprobs is not None else None)

    def _done(self) -> None:
        self._finished = True
        if self._on_done is not None:
            self._on_done(self)

    @property
    def seq_len(self) -> int:
        """Prompt tokens plus every token produced (the last one is not yet in the cache)."""
        return self.num_prompt_tokens + len(self.token_ids)

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self._it is not None:
            return next(self._it)
        # multi-seat: step the scheduler (and every other active request with it) until a token of ours is out
        while not self._buffer:
            if self._finished:
                if self.error is not None:
                    raise self.error
                raise StopIteration
            self._scheduler.step()
        return self._buffer.popleft()


class _PhaseClock:
    """Seconds by phase of a warm-up, and what the lean step's kernels cost within them: Triton compiles
    (models/precompile.py) and block-shape timing (models/fused.py), counted in this process while it ran."""

    def __init__(self) -> None:
        self.t0 = self.t = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.step_tuned: list[dict] = []  # StepRunner.tune's measurements (models/step_tune.py)
        self.start = self._counters()
        fused = sys.modules.get("expresslane.engine.models.fused")
        self.log_start = len(fused.TUNING_LOG) if fused is not None else 0

    @staticmethod
    def _counters() -> dict[str, float]:
        # the lean step's modules are imported only where it runs (Triton's jit is not set up on a CPU host)
        pre = sys.modules.get("expresslane.engine.models.precompile")
        fused = sys.modules.get("expresslane.engine.models.fused")
        out = {}
        if pre is not None:
            out.update(compile_s=pre.STATS.seconds, compile_jobs=pre.STATS.jobs, compile_threads=pre.threads())
        if fused is not None:
            out.update(pick_timing_s=fused.PICK_STATS.timing_s, picks=fused.PICK_STATS.picks)
        return out

    def _picked(self) -> list[str]:
        """The block shapes this warm-up picked: "kernel NxK rows: shape (one-row us, rows-row us where timed)"."""
        fused = sys.modules.get("expresslane.engine.models.fused")
        if fused is None:
            return []
        out = []
        for e in fused.TUNING_LOG[self.log_start:]:
            best = fused._label(tuple(e["best"]))
            rows_us = e.get("us_rows", {}).get(best)
            out.append(f"{e['kernel']} {e['n']}x{e['k']} r{e['rows']}: {best} ({e['us'].get(best)} us"
                       + (f", {rows_us} us at {e['rows']} rows)" if rows_us is not None else ")"))
        return out

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self.t, 3)
        self.t = now

    def report(self) -> dict:
        end = self._counters()
        within = {k: (round(v - self.start.get(k, 0), 3) if k != "compile_threads" else v) for k, v in end.items()}
        picked = self._picked()
        return {"seconds": round(time.perf_counter() - self.t0, 3), "phases": self.phases, **within,
                **({"picked": picked} if picked else {}),
                **({"step_tuned": self.step_tuned} if self.step_tuned else {})}


class DecodeEngine:
    #: The most rows a multi-seat engine's warm-up times a step of (calibrate_step_costs).
    CALIBRATED_BATCH_ROWS = 8

    def __init__(self, model: Transformer, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 max_seq_len: int, attention: str | AttentionKind = "live", compile: bool = False,
                 cuda_graph: bool | None = None, speculation: SpeculationConfig | None = SpeculationConfig(),
                 compile_mode: str | None = None, lean: bool | None = None, lean_gemv: str = "auto",
                 seats: int = 1) -> None:
        kind = parse_attention(attention)
        cuda_graph = resolve_cuda_graph(cuda_graph, device.type, kind)
        if seats < 1:
            raise ValueError(f"seats must be >= 1, got {seats}")
        why = multi_seat_unsupported(device.type, kind, cuda_graph, lean_gemv, lean) if seats > 1 else None
        if why:
            raise ValueError(f"{seats} seats: {why}")
        if seats > 1 and device.type == "cuda":
            lean_gemv = "tensor-core"  # (auto or tensor-core: the family that takes several users' rows)
        k = speculation.k if speculation else 0
        seat_rows = min(SEAT_RP, seats * (1 + k)) if seats > 1 and device.type == "cuda" else 0
        self.seats = seats
        self.model = model
        self.config = config
        self.dtype = dtype
        self.device = device
        self.max_seq_len = max_seq_len
        self.attention = kind.value
        self.geometry = KVGeometry(config.num_layers, config.num_kv_heads, config.head_dim, max_seq_len, dtype, device)
        self.cache = StaticKVCache(self.geometry, seats)
        self.cos, self.sin = rope_tables(config.rope, config.head_dim, max_seq_len, dtype, device)
        self.seat_tokens = [0] * seats  # each seat's positions [0, n) hold valid KV
        self._cancel = threading.Event()
        self._arange = torch.arange(max_seq_len, device=device)
        # Speculation: None = off engine-wide; otherwise prompt lookup (or set_drafter) drafts up to k tokens,
        # verified in one forward of up to k + 1 rows.
        self.speculation = speculation
        self.spec_stats = SpecStats()  # cumulative over requests (the server exports these)
        self._drafter_factory = None  # None: the config's default drafter (speculation.drafter), given step_costs
        # What a forward of 1 .. max_rows rows costs here: the default drafter verifies as many drafts as pay for
        # that (decode/speculative.py AdaptiveDrafter). Assumed until warmup() measures it.
        self.step_costs = StepCosts.assumed()
        self.warmup_report: dict | None = None  # warmup(): seconds by phase, compiles and block-shape timing
        self.lean_gemv = lean_gemv

        def runner(gemv: str) -> StepRunner:
            return StepRunner(model, self.cache, self.cos, self.sin, attention=kind, compile=compile,
                              cuda_graph=cuda_graph, max_rows=1 + (speculation.k if speculation else 0),
                              compile_mode=compile_mode, lean=lean, lean_gemv=gemv, seat_rows=seat_rows)

        # Plain greedy requests run as a GreedyChain (decode/chain.py): the device one step ahead of the host
        # on every step without drafts, speculating or not. False runs them through the per-token loop (A/B
        # and tests).
        self.greedy_chain = True
        # lean_gemv="per-request": a runner (and its chain and step costs) of each GEMV family over the one
        # model and cache, and each request runs on the family its prompt suits (decode/family.py), from its
        # first step to its last, so its greedy tokens are the same with speculation on and off. The choice
        # weighs what speculation earns, so it needs speculation. Where the lean step does not apply (a CPU)
        # both runners run the PyTorch step and the choice changes nothing but which runner's buffers run.
        self._families: dict[str, tuple[StepRunner, GreedyChain]] = {}
        self._family_costs: dict[str, StepCosts] = {}
        self.family_policy = FamilyPolicy()
        self.family_requests: dict[str, int] = {}  # requests run by each family (per-request engines)
        self.family: str | None = None  # the family the engine's runner is now (per-request engines)
        # Set: every request runs this family, unchosen (the warm-up of each family; benches and tests).
        self.pinned_family: str | None = None
        if lean_gemv == PER_REQUEST:
            if speculation is None:
                raise ValueError("lean_gemv per-request chooses a GEMV family for what speculation earns on "
                                 "the request: it needs speculation on")
            for family in FAMILIES:
                r = runner(family)
                self._families[family] = (r, GreedyChain(r))
                self._family_costs[family] = StepCosts.assumed()
                self.family_requests[family] = 0
            self.use_family(FAMILIES[0])
        else:
            self.runner = runner(lean_gemv)
            self._chain = GreedyChain(self.runner)
        # Several seats: every active request's rows in one forward a step (decode/batch.py).
        self.scheduler: SeatScheduler | None = None
        if seats > 1:
            why = self.runner.multi_seat_unsupported()
            if why:
                raise ValueError(f"{seats} seats: {why}")
            self.scheduler = SeatScheduler(lambda *a: self.runner.forward_rows(*a), seats,
                                           max_step_rows=seat_rows or None,
                                           on_finished=lambda gen: self.spec_stats.add(gen.spec))

    @property
    def cached_tokens(self) -> int:
        """Positions [0, cached_tokens) of seat 0 hold valid KV (a batch-1 engine's one sequence)."""
        return self.seat_tokens[0]

    @cached_tokens.setter
    def cached_tokens(self, n: int) -> None:
        self.seat_tokens[0] = n

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", max_seq_len: int = 4096, attention: str | None = None,
                        compile: bool = False, cuda_graph: bool | None = None,
                        speculation: SpeculationConfig | None = SpeculationConfig(),
                        compile_mode: str | None = None, lean: bool | None = None,
                        lean_gemv: str = "auto", seats: int = 1) -> "DecodeEngine":
        """lean: the fused T = 1 step on CUDA (decode/runner.py). None (the default) wherever it applies,
        True or ValueError, False the PyTorch step. lean_gemv: its GEMV kernels (models/lean.py: auto,
        cuda-core, tensor-core). seats: requests decoded together, one forward a step (decode/batch.py)."""
        config = ModelConfig.from_model_dir(model_dir)
        return cls._built(config, lambda dt, dev: load_model(model_dir, config, dt, dev), dtype=dtype,
                          device=device, max_seq_len=max_seq_len, attention=attention, compile=compile,
                          cuda_graph=cuda_graph, speculation=speculation, compile_mode=compile_mode, lean=lean,
                          lean_gemv=lean_gemv, seats=seats)

    @classmethod
    def from_checkpoint_tensors(cls, config: dict, tensors: dict[str, torch.Tensor], **options) -> "DecodeEngine":
        """An engine over a checkpoint held in memory: config.json's dict and {HF name: tensor} (the dict is
        emptied), e.g. decode/shapes.py's random checkpoints; options as from_pretrained's."""
        model_config = ModelConfig.from_dict(config)
        return cls._built(model_config, lambda dt, dev: model_from_tensors(model_config, tensors, dt, dev),
                          **options)

    @classmethod
    def _built(cls, config: ModelConfig, load, *, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", max_seq_len: int = 4096, attention: str | None = None,
               **options) -> "DecodeEngine":
        if dtype == "auto":  # the checkpoint's own dtype, like vLLM's --dtype auto for these dtypes
            dtype = config.checkpoint_dtype or "float32"
        torch_dtype, device = parse_dtype(dtype), torch.device(device)
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        if attention is None:
            attention = default_attention(device.type)
        parse_attention(attention)  # a bad name fails before the weights load
        model = load(torch_dtype, device)
        return cls(model, config, dtype=torch_dtype, device=device, max_seq_len=max_seq_len,
                   attention=attention, **options)

    @property
    def runners(self) -> tuple[StepRunner, ...]:
        """Every runner this engine holds: one, or one per GEMV family (lean_gemv per-request)."""
        return tuple(r for r, _ in self._families.values()) if self._families else (self.runner,)

    @property
    def families(self) -> tuple[str, ...]:
        """The GEMV families this engine chooses from per request (empty: it runs one runner)."""
        return tuple(self._families)

    @property
    def default_step_costs(self) -> StepCosts:
        """The step costs of the family a request runs by default (the engine's own where it runs one)."""
        return self._family_costs[FAMILIES[0]] if self._families else self.step_costs

    def use_family(self, family: str) -> None:
        """Run on `family`'s runner, chain and step costs from the next step on (per-request engines; between
        requests: a request runs one family throughout)."""
        if family not in self._families:
            raise ValueError(f"no runner of GEMV family {family!r} here (families: {list(self._families)})")
        self.runner, self._chain = self._families[family]
        self.step_costs = self._family_costs[family]
        self.family = family

    def choose_family(self, prompt_token_ids: Sequence[int] | None) -> FamilyChoice:
        """The family a request with these prompt ids runs on (decode/family.py), from each family's measured
        step costs. ValueError on an engine with one runner."""
        if not self._families or self.speculation is None:
            raise ValueError("this engine runs one GEMV family (lean_gemv is not per-request)")
        return choose_family(prompt_token_ids, self._family_costs, self.speculation, self.family_policy)

    @property
    def compile(self) -> bool:
        return self.runner.compile

    @property
    def cuda_graph(self) -> bool:
        return self.runner.cuda_graph

    def set_drafter(self, factory) -> None:
        """Use another drafter (e.g. `lambda: DraftModelDrafter(small_engine)`): a callable returning a fresh
        `Drafter` per request; None: the default again (the config's, with this engine's step costs). Needs
        speculation configured (its k bounds the drafts)."""
        if self.speculation is None:
            raise ValueError("speculation is off in this engine (speculation=None)")
        self._drafter_factory = factory

    def new_drafter(self, start_length: int) -> Drafter | None:
        """A fresh drafter for a request whose next token goes to position start_length (None: speculation
        off)."""
        if self.speculation is None:
            return None
        if self._drafter_factory is None:
            return self.speculation.drafter(self.step_costs, start_length)
        return self._drafter_factory()

    # ------------------------------------------------------------------ introspection
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def weight_bytes(self) -> int:
        """Bytes of distinct parameter storage (tied embeddings counted once)."""
        seen: dict[int, int] = {}
        for p in self.model.parameters():
            seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        return sum(seen.values())

    def capabilities(self) -> dict:
        return {
            "sampling": list(HONOURED_SAMPLING_OPTIONS),
            "repetition_penalty_scope": "generated tokens (plus prompt_token_ids when the caller supplies them)",
            "logprobs": True,
            "max_top_logprobs": lp.MAX_TOP_LOGPROBS,
            "logprobs_mode": "raw_logprobs",
            "structured_output_backend": GRAMMAR_BACKEND,
            "max_seq_len": self.max_seq_len,
            "model_type": self.config.model_type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "eos_token_ids": list(self.eos_token_ids),
            "vocab_size": self.vocab_size,
            "speculative": self.speculation is not None,
            "speculation": ({"method": "prompt_lookup", "k": self.speculation.k,
                             "ngram_min": self.speculation.ngram_min, "ngram_max": self.speculation.ngram_max,
                             "adaptive": self.speculation.adaptive, "step_costs": self.step_costs.as_dict()}
                            if self.speculation else None),
            "step": self.runner.mode.value,
            "attention": self.attention,
            "lean_gemv": self.lean_gemv,
            **({"gemv_families": {f: {"gemv": r.lean_gemv, "step_costs": self._family_costs[f].as_dict(),
                                      "requests": self.family_requests[f]}
                                  for f, (r, _) in self._families.items()}} if self._families else {}),
        }

    # ------------------------------------------------------------------ KV in
    def _check_seat(self, seat: int) -> int:
        if not 0 <= seat < self.seats:
            raise ValueError(f"seat {seat} outside [0, {self.seats})")
        if self.scheduler is not None and self.scheduler.busy(seat):
            raise ValueError(f"seat {seat} is decoding a request")
        return seat

    @torch.inference_mode()
    def inject(self, k: torch.Tensor, v: torch.Tensor, num_tokens: int, seat: int = 0) -> None:
        """Copy dense [num_layers, num_tokens, num_kv_heads, head_dim] K/V into `seat`'s cache positions
        [0, num_tokens) (a multi-seat engine: between steps, into a seat no request decodes in)."""
        self._check_seat(seat)
        self.cache.write_prefix(k, v, num_tokens, seat)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the caller may reuse k/v's buffer as soon as we return
        self.seat_tokens[seat] = num_tokens

    def disable_compile(self) -> None:
        """Decode with the plain (eager) step from now on, e.g. when torch.compile fails on this host."""
        for runner in self.runners:
            runner.disable_compile()

    def warmup(self, steps: int = 4) -> None:
        """Run a short prefill + decode so the first request does not pay one-time costs (allocator,
        kernels, torch.compile, each verify bucket's CUDA graph). Leaves the cache logically empty.
        `warmup_report` says where its time went (seconds by phase; on a GPU the lean step's kernel compiles
        and block-shape timing within them). A per-request engine warms each family's runner in turn (its
        kernels, graphs and step costs) and reports each (`families`)."""
        if not self._families:
            self._warmup(steps)
            return
        reports, pinned = {}, self.pinned_family
        try:
            for family in self._families:
                self.pinned_family = family
                self.use_family(family)
                self._warmup(steps)
                reports[family] = self.warmup_report
        finally:
            self.pinned_family = pinned
            self.use_family(FAMILIES[0])
        for family in self._families:
            self.family_requests[family] = 0  # the warm-up's requests are not requests
        self.warmup_report = {"seconds": round(sum(r["seconds"] for r in reports.values()), 3),
                              "families": reports}

    def _warmup(self, steps: int) -> None:
        clock = _PhaseClock()
        n = min(8, self.max_seq_len - steps - 1)
        self.prefill(list(range(n)))
        clock.mark("prefill")
        clock.step_tuned = self.runner.tune()
        if clock.step_tuned:
            clock.mark("step_tune")
        if self.scheduler is not None:  # every step runs over seats: the row counts' graphs, nothing else
            self.runner.capture_seats()
            if not self.runner.lean:
                self.runner.warm_rows()  # the compiled CPU step's graphs, compiled now
            clock.mark("capture")
        else:
            self.runner.capture()
            clock.mark("capture")
            with torch.inference_mode():
                for t in range(1, self.runner.max_rows + 1):  # every T the speculative path can take
                    if n + t < self.max_seq_len:
                        self.runner.forward(self._arange[:t], n)
            clock.mark("verify_rows")
        seat = 0 if self.scheduler is not None else None
        for _ in self.generate(0, n, SamplingParams(max_tokens=steps, ignore_eos=True), seat=seat):
            pass
        for _ in self.generate(0, n, SamplingParams(max_tokens=steps, temperature=1.0, top_p=0.9, top_k=5,
                                                    ignore_eos=True, presence_penalty=0.5, seed=0), seat=seat):
            pass
        clock.mark("generate")
        if self.speculation is not None:
            self.calibrate_step_costs()
            clock.mark("calibrate")
        self.cached_tokens = 0
        self.spec_stats = SpecStats()
        self.warmup_report = clock.report()

    @torch.inference_mode()
    def calibrate_step_costs(self, rounds: int = 3, reps: int = 5) -> StepCosts:
        """Measure what a forward of 1 .. max_rows rows costs here, near the start of the cache and near its
        end, keep it as `step_costs` (what the default drafter weighs a verify by) and return it. A one-row step
        is timed back to back, as the greedy chain runs plain steps (the device a step ahead of the host); a
        verify with the read of its rows' argmaxes after it, as the engine's verify reads them (the host waits).
        Each figure is the fastest of `rounds` means of `reps` (noise on a shared host only adds), and costs
        are made non-decreasing in the rows and in the length. Leaves the cache logically as it was (the rows
        it writes lie past the live length). A multi-seat engine measures its step over several users' rows
        (one forward_rows of r rows, r up to CALIBRATED_BATCH_ROWS; StepCosts extends past the table linearly)."""
        rows_max = self.runner.max_rows
        if self.scheduler is not None:
            rows_max = min(self.seats * rows_max, self.CALIBRATED_BATCH_ROWS)
        lengths = (min(16, self.max_seq_len - rows_max - 2), self.max_seq_len - rows_max - 1)
        if lengths[0] < 1 or lengths[0] >= lengths[1]:
            return self.step_costs  # a cache too short to tell two lengths apart: keep what we have
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        one = self._arange[:1]
        table = []
        for pos in lengths:
            costs = []
            for r in range(1, rows_max + 1):
                rows = list(range(r))
                step = self._greedy_rows if self.scheduler is None else self._batch_rows
                step(rows, pos)  # warm (graphs are captured already)
                best = float("inf")
                for _ in range(rounds):
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        if r == 1 and self.scheduler is None:
                            self.runner.forward(one, pos)
                        else:
                            step(rows, pos)  # the verify's forward and read, as the engine runs it
                    sync()
                    best = min(best, (time.perf_counter() - t0) / reps)
                costs.append(max(best, costs[-1] if costs else 0.0))
            table.append(costs)
        short, long = table
        long = [max(a, b) for a, b in zip(short, long)]
        self.step_costs = StepCosts(lengths, tuple(short), tuple(long))
        if self.family is not None:
            self._family_costs[self.family] = self.step_costs
        return self.step_costs

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], seat: int = 0) -> torch.Tensor:
        """Full forward over a prompt from position 0, writing `seat`'s cache. Returns float32 logits [vocab] of
        the last position."""
        n = len(token_ids)
        if not 0 < n < self.max_seq_len:
            raise ValueError(f"prompt of {n} tokens must be in [1, max_seq_len={self.max_seq_len})")
        s0 = self.cache.seat_start(self._check_seat(seat))
        tokens = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        pos = self._arange[:n]
        ctx = StepContext(AttentionKind.LIVE, pos[:1], kv_len=n, prefill=True)
        ks, vs = self.cache.k_layers, self.cache.v_layers
        if s0:
            ks, vs = [k[s0:] for k in ks], [v[s0:] for v in vs]
        logits = self.model(tokens, pos, self.cos[:n], self.sin[:n], ks, vs, ctx)
        self.seat_tokens[seat] = n
        return logits

    # ------------------------------------------------------------------ decode
    def cancel(self) -> None:
        """Stop the running generation between steps (thread-safe). A multi-seat engine's requests are cancelled
        one by one (`Generation.cancel`, or the event passed as cancel_event=): this stops none of them."""
        self._cancel.set()

    def generate(self, first_token_id: int, num_prompt_tokens: int, params: SamplingParams,
                 cancel_event: threading.Event | None = None, grammar: RequestGrammar | None = None,
                 seat: int | None = None) -> Generation:
        """Yield token ids starting WITH first_token_id, continuing from position num_prompt_tokens.
        `grammar`: the request's structured-output matcher in its initial state; first_token_id is accepted
        into it here (GrammarError when the grammar refuses it). A multi-seat engine: `seat` names the seat whose
        cache holds the prompt; the request joins the scheduler's next step (decode/batch.py), and iterating it
        steps the scheduler (or `Generation.listen` takes its tokens as they come)."""
        if self.scheduler is not None and seat is None:
            raise ValueError(f"this engine has {self.seats} seats: name the request's seat")
        seat = self._check_seat(0 if seat is None else seat)
        if not 0 <= first_token_id < self.vocab_size:
            raise ValueError(f"first_token_id={first_token_id} outside the vocabulary [0, {self.vocab_size})")
        if not 0 < num_prompt_tokens <= self.seat_tokens[seat]:
            raise ValueError(f"num_prompt_tokens={num_prompt_tokens} but the cache holds {self.seat_tokens[seat]} "
                             "tokens: inject() or prefill() first")
        if num_prompt_tokens >= self.max_seq_len:
            raise ValueError(f"num_prompt_tokens={num_prompt_tokens} leaves no room (max_seq_len={self.max_seq_len})")
        params.check_vocab(self.vocab_size)
        if grammar is not None and not grammar.accept(first_token_id):
            raise GrammarError(f"first_token_id={first_token_id} is not allowed by the request's structured output "
                               "grammar (the prefill must sample it under the same constraint)")
        self._cancel.clear()
        gen = Generation(self, first_token_id, num_prompt_tokens, params, cancel_event, grammar)
        if self.scheduler is not None:
            self._join(gen, first_token_id, seat)
        return gen

    def _join(self, gen: Generation, first_token_id: int, seat: int) -> None:
        """A multi-seat engine's request into its seat of the scheduler (its first step is the next one)."""
        params = gen.params
        with torch.inference_mode():
            sampler = Sampler(params, self.vocab_size, self.eos_token_ids, self.device, grammar=gen.grammar)
        drafter = None
        if params.speculative and sampler.supports_speculation:
            drafter = self.new_drafter(gen.num_prompt_tokens)
        run = SequenceRun(gen, first_token_id, sampler, drafter, k=self.speculation.k if drafter else 0,
                          max_seq_len=self.max_seq_len, device=self.device)
        gen.seat, gen._scheduler = seat, self.scheduler
        self.scheduler.join(seat, gen, run)

    def _run(self, gen: Generation, first_token_id: int) -> Iterator[int]:
        """The token loop of a batch-1 engine: one SequenceRun (decode/sequence.py), a forward a step; plain
        greedy requests run as a greedy chain (`_run_chain`)."""
        params = gen.params
        with torch.inference_mode():
            sampler = Sampler(params, self.vocab_size, self.eos_token_ids, self.device, grammar=gen.grammar)
        if self._families:  # before the drafter: it weighs the chosen family's step costs
            if self.pinned_family:
                gen.family = FamilyChoice(self.pinned_family, {}, "pinned")
            elif not sampler.supports_speculation:  # whatever `speculative` says: the choice must not read it
                gen.family = FamilyChoice(FAMILIES[0], {}, "its sampling never speculates")
            else:
                gen.family = self.choose_family(params.prompt_token_ids)
            self.use_family(gen.family.family)
            self.family_requests[gen.family.family] += 1
        drafter: Drafter | None = None
        if params.speculative and sampler.supports_speculation:
            drafter = self.new_drafter(gen.num_prompt_tokens)
        if params.logprobs is None and sampler.plain_greedy and self.greedy_chain:
            if drafter is not None:
                drafter.start([*params.prompt_token_ids, first_token_id])
            limit = min(params.max_tokens, self.max_seq_len - gen.num_prompt_tokens)
            yield from self._run_chain(gen, first_token_id, limit, sampler.stop_ids, drafter)
            return
        run = SequenceRun(gen, first_token_id, sampler, drafter, k=self.speculation.k if drafter else 0,
                          max_seq_len=self.max_seq_len, device=self.device)
        cancelled = lambda: gen.cancel_event.is_set() or self._cancel.is_set()  # noqa: E731
        try:
            while True:
                for tok in run.emit():
                    yield tok
                if run.finished:
                    return
                if cancelled():
                    gen.finish_reason = "abort"
                    return
                rows = run.plan()
                run.consume(self.runner.forward(rows, run.pos))
                self.cached_tokens = run.pos
        finally:
            self.spec_stats.add(gen.spec)

    def _run_chain(self, gen: Generation, first_token_id: int, limit: int, stop_ids: set[int],
                   drafter: Drafter | None) -> Iterator[int]:
        """The token loop for plain greedy requests (decode/chain.py), with or without a drafter: the same
        tokens, stop rules, cache state, drafter calls and speculation counters as `_run`'s, with each plain
        step's successor queued on the device before the plain step's token is read.

        States (ChainState): SYNCED, nothing queued; AHEAD, one chain step queued whose input is out[-1] at
        `pos`: it is row 0 of the next forward whatever the drafter proposes. AHEAD and no drafts: queue the
        step after it where the drafter cannot draft there (its hint), then read it (a plain step). AHEAD and
        drafts d (a wrong hint): read it (the target's token after out[-1]); if it is d[0], verify d[1:] with
        one forward of rows d at pos + 1 (the rest of the verify `_run` does in one forward of rows
        [out[-1], *d]); SYNCED after. One draft: the rest is the chain's next step, queued before the read.
        SYNCED and drafts: `_run`'s verify."""
        out, chain = gen.token_ids, self._chain
        min_tokens, k = gen.params.min_tokens, (self.speculation.k if drafter else 0)
        pos = gen.num_prompt_tokens  # where out[-1] goes (its K/V is not in the cache yet)
        cancelled = lambda: gen.cancel_event.is_set() or self._cancel.is_set()  # noqa: E731
        state, queued = ChainState.SYNCED, -1  # AHEAD: `queued` is the queued step's number
        # Whether the drafter can propose after one more token (drafters without the hint: always).
        may_draft = (lambda: False) if drafter is None else getattr(drafter, "may_draft_next", lambda: True)
        pending = [first_token_id]  # tokens to emit
        try:
            while True:
                for tok in pending:
                    out.append(tok)
                    yield tok
                    gen.finish_reason = finish_reason(tok, len(out), limit, min_tokens, stop_ids)
                    if gen.finish_reason:
                        return  # a queued step runs out; its row lies past the live length
                if cancelled():
                    gen.finish_reason = "abort"
                    return
                # room: tokens the limit takes after the next one (drafts and queued steps stay inside it).
                room = limit - len(out) - 1
                drafts = drafter.propose(min(k, room)) if drafter and room > 0 else []
                if state is ChainState.SYNCED and not drafts:
                    chain.start(out[-1], pos)
                    state, queued = ChainState.AHEAD, chain.submit()
                if state is ChainState.AHEAD:
                    # The step after, queued before this one is read: after a plain step when the limit takes
                    # its token and the drafter cannot draft there (so it is the next forward, whole); for one
                    # draft too (room >= 1), since that verify's second row, the draft at pos + 1, is the
                    # chain's next step if the draft is right, and the next plain step if not.
                    one = len(drafts) == 1
                    nxt = chain.submit() if (not drafts and room > 0 and not may_draft()) or one else -1
                    tok = chain.result(queued)
                    if drafts and tok == drafts[0]:
                        gen.split_verifies += 1
                        if one:  # a kept draft: the next step likely drafts too, so nothing queued after
                            pending, nxt = [tok, chain.result(nxt)], -1
                        else:
                            pending = greedy_accept(drafts, [tok, *self._greedy_rows(drafts, pos + 1)])
                    else:
                        pending = [tok]
                    state, queued = (ChainState.AHEAD, nxt) if nxt >= 0 else (ChainState.SYNCED, -1)
                else:
                    pending = greedy_accept(drafts, self._greedy_rows([out[-1], *drafts], pos))
                accepted = len(pending) - 1
                pos += 1 + accepted
                self.cached_tokens = pos
                gen.spec.record(len(drafts), accepted)
                if drafter:
                    drafter.extend(pending)
        finally:
            self.spec_stats.add(gen.spec)

    @torch.inference_mode()
    def _batch_rows(self, rows: list[int], pos: int) -> list[int]:
        """A multi-seat engine's forward of `rows` (seat 0 at pos ..) and the read of their argmaxes."""
        return self.runner.forward_rows([(0, pos, rows)], want_argmax=True)[1]

    @torch.inference_mode()
    def _greedy_rows(self, rows: list[int], pos: int) -> list[int]:
        """One forward of `rows` at positions pos ..: each row's argmax (one host sync)."""
        return self.runner.greedy_rows(rows, pos)
