"""The lean T = 1 decode step: the Transformer's forward for one token as 6 fused kernels a layer.

Per layer: `norm_qkv_rope` (RMSNorm + QKV GEMV + bias + RoPE + the K/V cache write), the split-KV attention
(partial + merge, models/triton_decode.py), `gemv_residual` (o_proj into the residual), `norm_gate_up_silu`
(RMSNorm + gate/up GEMV + SwiGLU), `gemv_residual` (down_proj into the residual). Around them one embedding
gather and `norm_gemv` (final RMSNorm + lm_head, float32 logits; in the greedy chain's step also the argmax,
folded into the same kernel, and the position advance). Every buffer is the step's own and the
position is read from the device, so the whole step is captured as one CUDA graph (decode/runner.py owns that).

It computes what `Transformer.forward` computes for T = 1 with the same roundings (models/fused.py says
where); it reads the same parameters (no copies: the QKV and gate/up weights are already concatenated).
Models with per-head q/k norms (Qwen3) are not covered: `LeanStep.supports` says so and the runner keeps the
PyTorch step for them.

The row-invariant verify: the same step over R = 2 .. fused.MAX_ROWS tokens at start .. start + R - 1 (a verify of
R - 1 drafts). Every kernel loads each weight tile once for all R rows and gives each row exactly the operations,
block shapes and reduction order of the T = 1 step (models/fused.py); the attention runs each row as a T = 1
step at its own position, with that step's splits (models/triton_decode.py: split_kv_attention_rows). So row r's
logits and K/V are bit-identical to the T = 1 step's at start + r, and greedy output with speculation on equals
off on a GPU in bf16 (tests/unit/engine/test_fused_kernels.py). Every kernel is given the step's max_rows, so
its block shape is one for all row counts and is picked among those whose max_rows-row kernel does not spill
(fused.pick_config).

Two kernel families for the GEMVs (the engine's `lean_gemv`, the node's --lean-gemv): `cuda-core`
(models/fused.py: the fastest one-row step; each further verify row costs about one more step of compute) and
`tensor-core` (models/fused_dot.py: one tl.dot a projection and a separate RMSNorm kernel; a verify of five
rows costs about what one row does, one row a little more than cuda-core's). `auto` (the default) is cuda-core
for every model. Measured on the H200 (docs/bench/2026-12-04-gpu-check/): at the 8B shape the tensor-core
one-row step costs 4 % more (4.22 vs 4.04 ms), so a speculating node on text that never repeats runs at
0.954-0.958x of a node without speculation, below the 0.97x that speculation on by default must keep; with
cuda-core it runs at 1.00x (the adaptive drafter pauses), and gains 1.18x / 1.55x on the copy model's recorded
code-edit / agentic requests and 1.95x with an oracle at k = 4. `tensor-core` is the opt-in for traffic that
repeats: a verify of five rows costs 1.08x one row instead of 2.49x, so the same requests gain 1.62x / 2.75x and
the oracle 4.26x (1,052 tok/s at 1k). At the 1B shape (hidden 2048) its one-row step costs 22 % more (1.02 vs
0.84 ms). An engine runs one family for all its steps, so its greedy tokens are the same with speculation on
and off; only with cuda-core are they also the same bits as a node built without speculation.

The tensor-core family's norms run as kernels of their own (`kernel`, the default) or as the tails of the
residual kernels before them (`tail`, LEAN_NORMS: `set_norm`, the bench's --lean-norm), and its projections may
prefetch their first weight tiles into the L2 before their PDL wait (`set_l2_prefetch`, --lean-l2-prefetch): the
candidates for the gap its one-row step loses, both measured slower (an H100, 2026-12-05: the one-row step at
1.057x the CUDA-core one at 8B with the norm kernels, 1.086x with the tail, 1.116x with the tail and the prefetch;
docs/bench/2026-12-05-h100-gpu-check/probe_lean_norm.py).
"""

from __future__ import annotations

import torch

from . import fused, fused_dot
from .transformer import Transformer
from .triton_decode import split_kv_attention_rows, split_kv_attention_seats


GEMV_FAMILIES = ("auto", "cuda-core", "tensor-core")
#: How a verify's attention runs (models/triton_decode.py split_kv_attention_rows): per-row (the default: one
#: program per row, side by side so the rows share the cache reads through L2) or shared (one program reads each
#: cache tile once for every row; each row's bits the same; measured not faster: docs/performance.md).
VERIFY_ATTENTION = ("per-row", "shared")
#: Where the tensor-core family's RMSNorms run (fused_dot.py): `kernel` (the default: `rms_rows`, a kernel of
#: its own before each projection that reads a normalised input, two a layer) or `tail` (the o_proj / down_proj
#: kernel's last program to finish normalises the residual it wrote: `gemv_residual(norm=...)`; only the first
#: layer's input norm keeps its kernel). The same sums either way; measured slower than `kernel` (see above).
LEAN_NORMS = ("kernel", "tail")


def gemv_family(choice: str = "auto") -> str:
    """The GEMV kernel family of a lean step (auto: cuda-core, the one that never makes speculation slower than
    no speculation: see above)."""
    if choice not in GEMV_FAMILIES:
        raise ValueError(f"lean_gemv {choice!r}: one of {', '.join(GEMV_FAMILIES)}")
    return "cuda-core" if choice == "auto" else choice


class LeanStep:
    #: Slots of the greedy step's token ring: the host reads each step's slot before RING more steps ran.
    RING = 8

    def __init__(self, model: Transformer, cos: torch.Tensor, sin: torch.Tensor,
                 k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], max_rows: int = 1,
                 gemv: str = "auto", seat_rows: int = 0) -> None:
        why = self.unsupported_reason(model)
        if why:
            raise ValueError(f"the lean step does not cover this model: {why}")
        if not 1 <= max_rows <= fused.MAX_ROWS:
            raise ValueError(f"the lean step takes 1..{fused.MAX_ROWS} rows, not {max_rows}")
        self.gemv = gemv_family(gemv)
        if seat_rows and (self.gemv != "tensor-core" or not 1 <= seat_rows <= fused_dot.RP):
            raise ValueError(f"a step over several users' rows runs the tensor-core GEMVs (their row count is a "
                             f"runtime argument, each row's bits its own) on 1..{fused_dot.RP} rows; got "
                             f"{seat_rows} rows with {self.gemv}")
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.cos, self.sin = cos, sin
        self.k_layers, self.v_layers = k_layers, v_layers
        self.max_rows = max_rows
        self.seat_rows = seat_rows  # forward_seats takes up to this many rows (0: not built for it)
        self.verify_attention = "per-row"
        self.norm = "kernel"
        self.l2_prefetch = False
        p = next(model.parameters())
        dtype, device = p.dtype, p.device
        # Each row count's own buffers (a captured graph's output stays valid until that graph replays again).
        # x: the residual stream.
        self._bufs = {r: (torch.empty(r, cfg.hidden_size, dtype=dtype, device=device),
                          torch.empty(r, cfg.q_size, dtype=dtype, device=device),
                          torch.empty(r, cfg.intermediate_size, dtype=dtype, device=device),
                          torch.empty(r, cfg.vocab_size, dtype=torch.float32, device=device))
                      for r in range(1, max(max_rows, seat_rows) + 1)}
        self.x, self.q, self.h, self.logits = self._bufs[1]
        # tensor-core: each row count's normalised input (fused_dot.rms_rows's output, the projections' input)
        self._normed = {r: torch.empty(r, cfg.hidden_size, dtype=dtype, device=device)
                        for r in range(1, max(max_rows, seat_rows) + 1)} if self.gemv == "tensor-core" else {}
        self._ticket = fused_dot.new_ticket(device) if self.gemv == "tensor-core" else None  # the norm tail's
        self.argmax_keys = fused.new_argmax_keys(cfg.vocab_size, device)
        # The greedy step's (step number, token) ring (fused.greedy_advance): pinned host memory on a GPU, which
        # the kernel writes over the bus, so the host reads the token with no copy in the stream; greedy_seq
        # counts the greedy steps run (mod 2^31 in the ring), warm-ups and timing runs included.
        self.greedy_seq = torch.zeros(1, dtype=torch.int64, device=device)
        self.token_ring = torch.full((self.RING,), -1, dtype=torch.int64, pin_memory=device.type == "cuda")
        if device.type != "cuda":
            self.token_ring = self.token_ring.to(device)

    def set_verify_attention(self, kind: str) -> None:
        """per-row or shared (VERIFY_ATTENTION); a captured graph keeps the kernel it was captured with."""
        if kind not in VERIFY_ATTENTION:
            raise ValueError(f"verify attention {kind!r}: one of {', '.join(VERIFY_ATTENTION)}")
        self.verify_attention = kind

    def set_norm(self, where: str) -> None:
        """kernel or tail (LEAN_NORMS): where the tensor-core family's norms run; a captured graph keeps the
        kernels it was captured with. ValueError for the CUDA-core family (its norms are folded into the
        projections already)."""
        if where not in LEAN_NORMS:
            raise ValueError(f"lean norm {where!r}: one of {', '.join(LEAN_NORMS)}")
        if where != "kernel" and self.gemv != "tensor-core":
            raise ValueError(f"the norm tail is the tensor-core family's; this step runs {self.gemv}")
        self.norm = where

    def set_l2_prefetch(self, on: bool) -> None:
        """Whether the tensor-core family's projections prefetch their first weight tiles into the L2 before
        their PDL wait (fused_dot._weights_to_l2; measured slower, like the norm tail); a captured graph keeps the
        kernels it was captured with. ValueError for the CUDA-core family (its kernels load their first tile
        before the wait already)."""
        if on and self.gemv != "tensor-core":
            raise ValueError(f"the L2 prefetch is the tensor-core family's; this step runs {self.gemv}")
        self.l2_prefetch = bool(on)

    @staticmethod
    def unsupported_reason(model: Transformer) -> str | None:
        cfg = model.config
        if cfg.qk_norm:
            return "per-head q/k RMSNorm (Qwen3)"
        if cfg.head_dim % 2:
            return f"odd head_dim {cfg.head_dim}"
        return None

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """tokens [R] long (R <= max_rows; token r at position start + r), start [1] long (both on the
        device). Returns float32 logits [R, vocab] (the step's own buffer for R rows). greedy (R = 1): also the
        greedy chain's advance (decode/chain.py), on the device: tokens[0] = the logits' argmax (torch.argmax's
        answer: the first row of the maximum), start += 1, greedy_seq += 1 and token_ring[greedy_seq % RING] =
        (greedy_seq mod 2^31) * 2^32 + token; each lm_head program writes its best (value, first row) as one
        int64 key, one one-program kernel after it takes the largest and does the rest."""
        m, cfg = self.model, self.cfg
        r = tokens.shape[0]
        if r not in self._bufs:
            raise ValueError(f"this lean step takes 1..{self.max_rows} rows, got {r}")
        if greedy and r != 1:
            raise ValueError("the greedy step takes one row")
        x, q, h, logits = self._bufs[r]
        torch.index_select(m.embed_tokens.weight, 0, tokens, out=x)
        shared = r > 1 and self.verify_attention == "shared"
        if self.gemv == "tensor-core":
            return self._forward_dot(tokens, start, greedy, x, q, h, logits, self._normed[r], shared)
        q3 = q.view(r, cfg.num_heads, cfg.head_dim)
        for layer, kc, vc in zip(m.layers, self.k_layers, self.v_layers):
            att = layer.self_attn
            fused.norm_qkv_rope(x, layer.input_layernorm.weight, layer.input_layernorm.eps,
                                att.qkv_proj.weight, att.qkv_proj.bias, self.cos, self.sin, start, q, kc, vc,
                                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, max_rows=self.max_rows)
            out = split_kv_attention_rows(q3, kc, vc, start, att.scale, shared=shared)
            fused.gemv_residual(out.view(r, -1), att.o_proj.weight, att.o_proj.bias, x, max_rows=self.max_rows)
            mlp = layer.mlp
            fused.norm_gate_up_silu(x, layer.post_attention_layernorm.weight,
                                    layer.post_attention_layernorm.eps, mlp.gate_up_proj.weight,
                                    mlp.gate_up_proj.bias, h, max_rows=self.max_rows)
            fused.gemv_residual(h, mlp.down_proj.weight, mlp.down_proj.bias, x, max_rows=self.max_rows)
        keys = fused.norm_gemv(x, m.norm.weight, m.norm.eps, m.lm_head.weight, logits,
                               argmax_keys=self.argmax_keys if greedy else None, max_rows=self.max_rows)
        if greedy:
            fused.greedy_advance(self.argmax_keys, keys, tokens, start, self.token_ring, self.greedy_seq)
        return logits

    def forward_seats(self, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One forward over several users' rows (decode/batch.py): tokens [R] long (R <= seat_rows), rows
        [2 * fused_dot.RP] long, row r's position at rows[r] and its cache row (its seat's first row plus the
        position) at rows[RP + r], all on the device. Returns float32 logits [R, vocab] (the step's own buffer for
        R rows). Each row's logits and K/V are the bits of a one-row step of its sequence alone: the tensor-core
        GEMVs compute each row from its own input (the row count is a runtime argument) and each row's attention
        is a one-row step over its own seat (split_kv_attention_seats)."""
        r = tokens.shape[0]
        if not 1 <= r <= self.seat_rows:
            raise ValueError(f"this lean step takes 1..{self.seat_rows} rows of several users, got {r}")
        x, q, h, logits = self._bufs[r]
        torch.index_select(self.model.embed_tokens.weight, 0, tokens, out=x)
        return self._forward_dot(tokens, None, False, x, q, h, logits, self._normed[r], False, seat_rows=rows)

    def _forward_dot(self, tokens, start, greedy, x, q, h, logits, xn, shared, seat_rows=None) -> torch.Tensor:
        """forward's layers with the tensor-core family (models/fused_dot.py); seat_rows: forward_seats's rows."""
        m, cfg = self.model, self.cfg
        r = tokens.shape[0]
        q3 = q.view(r, cfg.num_heads, cfg.head_dim)
        tail, l2 = self.norm == "tail", self.l2_prefetch
        # the norm after each residual update: the next layer's input norm, the final one after the last layer
        after_mlp = [layer.input_layernorm for layer in m.layers[1:]] + [m.norm]

        def residual(a, w, b, ln):  # x += a @ w^T (+ b), then xn = ln(x): the kernel's tail, or rms_rows after it
            fused_dot.gemv_residual(a, w, b, x, norm=(ln.weight, ln.eps, xn, self._ticket) if tail else None, l2=l2)
            if not tail:
                fused_dot.rms_rows(x, ln.weight, ln.eps, xn)

        ln0 = m.layers[0].input_layernorm
        fused_dot.rms_rows(x, ln0.weight, ln0.eps, xn)
        for layer, kc, vc, next_ln in zip(m.layers, self.k_layers, self.v_layers, after_mlp):
            att, mlp, ln = layer.self_attn, layer.mlp, layer.post_attention_layernorm
            fused_dot.qkv_rope(xn, att.qkv_proj.weight, att.qkv_proj.bias, self.cos, self.sin,
                               start if seat_rows is None else seat_rows, q, kc, vc, cfg.num_heads, cfg.num_kv_heads,
                               cfg.head_dim, l2=l2, rows=seat_rows)
            if seat_rows is None:
                out = split_kv_attention_rows(q3, kc, vc, start, att.scale, shared=shared)
            else:
                out = split_kv_attention_seats(q3, kc, vc, seat_rows, att.scale)
            residual(out.view(r, -1), att.o_proj.weight, att.o_proj.bias, ln)
            fused_dot.gate_up_silu(xn, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, h, l2=l2)
            residual(h, mlp.down_proj.weight, mlp.down_proj.bias, next_ln)
        keys = fused_dot.gemv(xn, m.lm_head.weight, logits, argmax_keys=self.argmax_keys if greedy else None, l2=l2)
        if greedy:
            fused.greedy_advance(self.argmax_keys, keys, tokens, start, self.token_ring, self.greedy_seq)
        return logits

    def warm_greedy(self, tokens: torch.Tensor, start: torch.Tensor) -> None:
        """Run the greedy step once (compiles its kernels before a graph capture) and put tokens, start, the
        step count and the token ring back as they were: a warm-up is not a step (a reader of the ring that
        counted it would take each token one step late)."""
        # On a GPU the ring is pinned host memory that the kernel writes: a host copy is not in stream order, so
        # the stream is drained before the ring is saved and again before it is put back. Without the second
        # drain the warm-up's kernel could land after the restore and leave its (next step number, token) entry
        # in the slot the first real step's reader waits on, which would then take the warm-up's token.
        host_ring = self.token_ring.device.type == "cpu" and tokens.device.type == "cuda"
        if host_ring:
            torch.cuda.current_stream(tokens.device).synchronize()
        saved = [(t, t.clone()) for t in (tokens, start, self.greedy_seq, self.token_ring)]
        self.forward(tokens, start, greedy=True)
        if host_ring:
            torch.cuda.current_stream(tokens.device).synchronize()
        for t, old in saved:
            t.copy_(old)
