"""DecodeEngine: one model, one static KV cache, one request at a time (see the package docstring)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..models import ModelConfig, Transformer, load_model
from ..models.rope import rope_tables
from .cache import KVGeometry, StaticKVCache
from .sampling import HONOURED_SAMPLING_OPTIONS, Sampler, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_MODES = ("sliced", "masked")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {list(DTYPES)}")
        return dtype
    dtype = {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {list(DTYPES)}")
    return DTYPES[dtype]


# --cuda-graph on the command lines (server, decode bench) -> DecodeEngine(cuda_graph=...)
CUDA_GRAPH_CHOICES = {"auto": None, "on": True, "off": False}


def default_attention(device_type: str) -> str:
    """Fixed-shape masked attention on a GPU (CUDA-graph friendly), sliced to the live length elsewhere."""
    return "masked" if device_type == "cuda" else "sliced"


def resolve_cuda_graph(cuda_graph: bool | None, device_type: str, attention: str) -> bool:
    """Whether to replay the decode step as a CUDA graph. None (auto): wherever the step has fixed shapes
    (masked attention) and runs on a GPU. True where that does not hold is a ValueError."""
    if cuda_graph is None:
        return device_type == "cuda" and attention == "masked"
    if cuda_graph and (device_type != "cuda" or attention != "masked"):
        raise ValueError(f"cuda_graph needs device cuda and attention 'masked' (fixed shapes), "
                         f"got device {device_type} and attention {attention!r}")
    return cuda_graph


class Generation:
    """Iterator over token ids of one request. `finish_reason` is set when iteration ends:
    "stop" (eos / stop_token_ids), "length" (max_tokens or max_seq_len) or "abort" (cancelled)."""

    def __init__(self, engine: "DecodeEngine", first_token_id: int, num_prompt_tokens: int,
                 params: SamplingParams, cancel_event: threading.Event | None) -> None:
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.cancel_event = cancel_event or threading.Event()
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self._it = engine._run(self, first_token_id)

    def cancel(self) -> None:
        self.cancel_event.set()

    @property
    def seq_len(self) -> int:
        """Prompt tokens plus every token produced (the last one is not yet in the cache)."""
        return self.num_prompt_tokens + len(self.token_ids)

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        return next(self._it)


class DecodeEngine:
    def __init__(self, model: Transformer, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 max_seq_len: int, attention: str = "sliced", compile: bool = False,
                 cuda_graph: bool | None = None) -> None:
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        cuda_graph = resolve_cuda_graph(cuda_graph, device.type, attention)
        self.model = model
        self.config = config
        self.dtype = dtype
        self.device = device
        self.max_seq_len = max_seq_len
        self.attention = attention
        self.geometry = KVGeometry(config.num_layers, config.num_kv_heads, config.head_dim, max_seq_len, dtype, device)
        self.cache = StaticKVCache(self.geometry)
        self.cos, self.sin = rope_tables(config.rope, config.head_dim, max_seq_len, dtype, device)
        self.cached_tokens = 0  # positions [0, cached_tokens) hold valid KV
        self._cancel = threading.Event()
        # Step buffers reused every decode step.
        self._pos = torch.zeros(1, dtype=torch.long, device=device)
        self._arange = torch.arange(max_seq_len, device=device)
        # The step launched kernel by kernel (compiled or not). Sliced attention has a growing kv_len: compile
        # it with a symbolic length instead of recompiling.
        self.compile = compile
        self._direct_step = (torch.compile(self._decode_step, dynamic=attention == "sliced") if compile
                             else self._decode_step)
        # CUDA graph of one decode step (masked attention: every shape fixed, position read from self._pos on
        # the device). Replaying it costs one launch instead of one per kernel, which is what bounds batch-1
        # decode of a small model on a fast GPU. Captured on first use (warmup() does it at start).
        self.cuda_graph = cuda_graph
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_token = torch.zeros(1, dtype=torch.long, device=device)
        self._graph_logits: torch.Tensor | None = None
        self._step = self._graph_step if cuda_graph else self._direct_step

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", max_seq_len: int = 4096, attention: str | None = None,
                        compile: bool = False, cuda_graph: bool | None = None) -> "DecodeEngine":
        config = ModelConfig.from_model_dir(model_dir)
        if dtype == "auto":  # the checkpoint's own dtype, like vLLM's --dtype auto for these dtypes
            dtype = config.checkpoint_dtype or "float32"
        torch_dtype, device = parse_dtype(dtype), torch.device(device)
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        model = load_model(model_dir, config, torch_dtype, device)
        if attention is None:
            attention = default_attention(device.type)
        return cls(model, config, dtype=torch_dtype, device=device, max_seq_len=max_seq_len,
                   attention=attention, compile=compile, cuda_graph=cuda_graph)

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
            "logprobs": False,
            "max_seq_len": self.max_seq_len,
            "model_type": self.config.model_type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "eos_token_ids": list(self.eos_token_ids),
            "vocab_size": self.vocab_size,
        }

    # ------------------------------------------------------------------ KV in
    @torch.inference_mode()
    def inject(self, k: torch.Tensor, v: torch.Tensor, num_tokens: int) -> None:
        """Copy dense [num_layers, num_tokens, num_kv_heads, head_dim] K/V into cache positions [0, num_tokens)."""
        self.cache.write_prefix(k, v, num_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the caller may reuse k/v's buffer as soon as we return
        self.cached_tokens = num_tokens

    def disable_compile(self) -> None:
        """Decode with the plain (eager) step from now on, e.g. when torch.compile fails on this host."""
        self.compile = False
        self._direct_step = self._decode_step
        self._graph = self._graph_logits = None
        self._step = self._graph_step if self.cuda_graph else self._direct_step

    def warmup(self, steps: int = 4) -> None:
        """Run a short prefill + decode so the first request does not pay one-time costs (allocator,
        kernels, torch.compile). Leaves the cache logically empty."""
        n = min(8, self.max_seq_len - steps - 1)
        self.prefill(list(range(n)))
        for _ in self.generate(0, n, SamplingParams(max_tokens=steps, ignore_eos=True)):
            pass
        for _ in self.generate(0, n, SamplingParams(max_tokens=steps, temperature=1.0, top_p=0.9, top_k=5,
                                                    ignore_eos=True, presence_penalty=0.5, seed=0)):
            pass
        self.cached_tokens = 0

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Full forward over a prompt from position 0, writing the cache. Returns float32 logits [vocab] of the
        last position."""
        n = len(token_ids)
        if not 0 < n < self.max_seq_len:
            raise ValueError(f"prompt of {n} tokens must be in [1, max_seq_len={self.max_seq_len})")
        tokens = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        pos = self._arange[:n]
        logits = self.model(tokens, pos, self.cos[:n], self.sin[:n], self.cache.k_layers, self.cache.v_layers,
                            kv_len=n, is_causal=True)
        self.cached_tokens = n
        return logits

    # ------------------------------------------------------------------ decode
    def _decode_step(self, token: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        if self.attention == "masked":
            mask = (self._arange <= pos).unsqueeze(0)
            return self.model(token, pos, cos, sin, self.cache.k_layers, self.cache.v_layers,
                              kv_len=self.max_seq_len, attn_mask=mask)
        return self.model(token, pos, cos, sin, self.cache.k_layers, self.cache.v_layers, kv_len=kv_len)

    def _graph_step(self, token: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One decode step by CUDA-graph replay. `pos` must be self._pos (the graph reads that buffer); the
        returned logits live in the graph's output buffer until the next step."""
        self._graph_token.copy_(token)
        if self._graph is None:
            self._capture_graph()
        self._graph.replay()
        return self._graph_logits

    def _capture_graph(self) -> None:
        # Warm-up runs on a side stream first (cuBLAS workspaces, torch.compile), as capture requires. They and
        # the replay that follows compute the same step for the same token and position, so the cache rows they
        # write are the ones the step writes anyway.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._direct_step(self._graph_token, self._pos, self.max_seq_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._graph_logits = self._direct_step(self._graph_token, self._pos, self.max_seq_len)
        self._graph = graph

    def cancel(self) -> None:
        """Stop the running generation between steps (thread-safe)."""
        self._cancel.set()

    def generate(self, first_token_id: int, num_prompt_tokens: int, params: SamplingParams,
                 cancel_event: threading.Event | None = None) -> Generation:
        """Yield token ids starting WITH first_token_id, continuing from position num_prompt_tokens."""
        if not 0 <= first_token_id < self.vocab_size:
            raise ValueError(f"first_token_id={first_token_id} outside the vocabulary [0, {self.vocab_size})")
        if not 0 < num_prompt_tokens <= self.cached_tokens:
            raise ValueError(f"num_prompt_tokens={num_prompt_tokens} but the cache holds {self.cached_tokens} "
                             "tokens: inject() or prefill() first")
        if num_prompt_tokens >= self.max_seq_len:
            raise ValueError(f"num_prompt_tokens={num_prompt_tokens} leaves no room (max_seq_len={self.max_seq_len})")
        params.check_vocab(self.vocab_size)
        self._cancel.clear()
        return Generation(self, first_token_id, num_prompt_tokens, params, cancel_event)

    def _run(self, gen: Generation, first_token_id: int) -> Iterator[int]:
        params, out = gen.params, gen.token_ids
        with torch.inference_mode():
            sampler = Sampler(params, self.vocab_size, self.eos_token_ids, self.device)
        stop_ids = sampler.stop_ids
        # prompt + output <= max_seq_len, like vLLM's max_model_len.
        limit = min(params.max_tokens, self.max_seq_len - gen.num_prompt_tokens)
        with torch.inference_mode():
            token = torch.tensor([first_token_id], dtype=torch.long, device=self.device)
            sampler.observe(token)
        tok, pos = first_token_id, gen.num_prompt_tokens
        cancelled = lambda: gen.cancel_event.is_set() or self._cancel.is_set()  # noqa: E731
        while True:
            out.append(tok)
            yield tok
            if tok in stop_ids and len(out) >= params.min_tokens:
                gen.finish_reason = "stop"
                return
            if len(out) >= limit:
                gen.finish_reason = "length"
                return
            if cancelled():
                gen.finish_reason = "abort"
                return
            with torch.inference_mode():
                self._pos.fill_(pos)
                logits = self._step(token, self._pos, pos + 1)
                token = sampler.sample(logits, len(out))
                sampler.observe(token)
            self.cached_tokens = pos + 1
            pos += 1
            tok = int(token.item())  # the one host sync per token
