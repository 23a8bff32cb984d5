"""The lean step's fused kernels (models/fused.py) compute what the PyTorch step computes: each kernel against
the model's own modules for every block shape it may pick, and the whole lean T = 1 step (models/lean.py)
against `Transformer.forward` (logits and the cache row it writes), with and without biases, tied and untied
heads. On CPU through Triton's interpreter in float32 (tiny shapes: a few seconds), on a GPU in bf16 too; the
runner's selection of the lean step and greedy decoding through it are checked on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the jit functions are decorated and run

try:
    from expresslane.engine.models import fused, fused_dot
    from expresslane.engine.models.lean import LeanStep, gemv_family
except ImportError:  # no triton on this host
    fused = None
pytestmark = pytest.mark.skipif(fused is None, reason="needs triton")

from expresslane.engine.models.attention import AttentionKind, StepContext  # noqa: E402
from expresslane.engine.models.config import ModelConfig  # noqa: E402
from expresslane.engine.models.rope import apply_rope, rope_tables  # noqa: E402
from expresslane.engine.models.transformer import Transformer  # noqa: E402


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# float32: only summation order differs; bf16: one rounding of a projection output may differ by an ulp.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# A whole step in bf16 compounds those ulps over the layers: 0.021 seen on the H200 for this 2-layer model
# (the 1B / 8B shapes: 0.027 / 0.052, docs/bench/2026-12-01-gpu-lean-step); a wrong kernel gives O(1).
STEP_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module", autouse=True)
def fresh_interpreter(request):
    """Triton's interpreter refuses to run once vLLM was imported in the process (an earlier test module may
    have): then this module runs once in a fresh interpreter, and its result is asserted here."""
    if DEVICE != "cpu" or "vllm" not in sys.modules or os.environ.get("_EXPRESSLANE_FRESH_FUSED"):
        yield
        return
    env = dict(os.environ, TRITON_INTERPRET="1", _EXPRESSLANE_FRESH_FUSED="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(request.path), "-q", "-p", "no:cacheprovider"],
                          cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    pytest.skip("ran (and passed) in a fresh interpreter: vLLM is imported in this process")


def _config(bias: bool, tied: bool) -> ModelConfig:
    return ModelConfig(model_type="qwen2" if bias else "llama", vocab_size=96, hidden_size=64,
                       intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=tied, qkv_bias=bias,
                       o_bias=False, mlp_bias=False, qk_norm=False)


def _model(cfg: ModelConfig, dtype: torch.dtype, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
    return model.to(DEVICE, dtype).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


# Block shapes the tests run (rows or row pairs, K per iteration, prefetch): the measured loop and the prefetching
# one, each at a shape whose K-block is larger and one smaller than the test's K (64).
# On CPU (CI) three of each: the interpreter takes about a second per kernel call.
# A fifth element packs each group of that many columns into one accumulator (fused._fma): one per CPU list.
SINGLE = [(4, 2048, 0), (8, 512, 1), (32, 16, 1), (8, 64, 1, 4, 8)] + (
    [(16, 512, 0), (16, 512, 0, 8), (4, 1024, 1, 4, 8), (4, 2048, 0, 8, 4)] if DEVICE == "cuda" else [])
PAIRS = [(2, 2048, 0), (4, 512, 1), (2, 16, 1), (2, 32, 0, 4, 8)] + (
    [(8, 512, 0), (8, 256, 1, 8), (4, 512, 1, 8, 8), (8, 256, 0, 4, 2)] if DEVICE == "cuda" else [])


def _pairs(cands, limit):
    return [c for c in cands if c[0] <= limit]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_norm_qkv_rope_matches_the_step(dtype, bias):
    cfg = _config(bias, tied=False)
    model = _model(cfg, dtype, seed=1)
    layer = model.layers[0]
    s, d = 40, cfg.head_dim
    cos, sin = rope_tables(cfg.rope, d, s, dtype, DEVICE)
    x = torch.randn(cfg.hidden_size, device=DEVICE).to(dtype)
    pos = 29
    with torch.no_grad():
        qkv = layer.self_attn.qkv_proj(layer.input_layernorm(x[None]))
        qkv = qkv.view(1, cfg.num_heads + 2 * cfg.num_kv_heads, d)
        qk = apply_rope(qkv[:, : cfg.num_heads + cfg.num_kv_heads], cos[pos:pos + 1], sin[pos:pos + 1])
    ref_q, ref_k, ref_v = qk[0, : cfg.num_heads], qk[0, cfg.num_heads:], qkv[0, cfg.num_heads + cfg.num_kv_heads:]
    shapes = _pairs(PAIRS, d // 2)
    if DEVICE == "cpu":  # CI: each block shape once, split between the two bias variants
        shapes = shapes[:2] if bias else shapes[2:]
    for cfg_ in shapes:
        kc = torch.full((s, cfg.num_kv_heads, d), float("nan"), dtype=dtype, device=DEVICE)
        vc = kc.clone()
        q = torch.full((cfg.q_size,), float("nan"), dtype=dtype, device=DEVICE)
        fused.norm_qkv_rope(x, layer.input_layernorm.weight, cfg.rms_norm_eps, layer.self_attn.qkv_proj.weight,
                            layer.self_attn.qkv_proj.bias, cos, sin, torch.tensor([pos], device=DEVICE), q, kc, vc,
                            cfg.num_heads, cfg.num_kv_heads, d, config=cfg_)
        assert _rel(q.view(cfg.num_heads, d), ref_q) < TOL[dtype], cfg_
        assert _rel(kc[pos], ref_k) < TOL[dtype], cfg_
        assert _rel(vc[pos], ref_v) < TOL[dtype], cfg_
        others = torch.ones(s, dtype=torch.bool)
        others[pos] = False
        assert torch.isnan(kc[others]).all() and torch.isnan(vc[others]).all()  # only row `pos` is written


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_residual_gate_up_and_head_match_the_step(dtype):
    cfg = _config(bias=True, tied=False)
    model = _model(cfg, dtype, seed=2)
    layer = model.layers[1]
    x = torch.randn(cfg.hidden_size, device=DEVICE).to(dtype)
    a = torch.randn(cfg.q_size, device=DEVICE).to(dtype)
    with torch.no_grad():
        ref_res = x + layer.self_attn.o_proj(a[None])[0]
        gate, up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(x[None]))[0].split(cfg.intermediate_size)
        ref_h = torch.nn.functional.silu(gate) * up
        ref_logits = model.lm_head(model.norm(x)).float()
    for c in SINGLE:
        res = x.clone()
        fused.gemv_residual(a, layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, res, config=c)
        assert _rel(res, ref_res) < TOL[dtype], c
        logits = torch.full((cfg.vocab_size,), float("nan"), device=DEVICE)
        fused.norm_gemv(x, model.norm.weight, cfg.rms_norm_eps, model.lm_head.weight, logits, config=c)
        assert _rel(logits, ref_logits) < TOL[dtype], c
    for c in PAIRS:
        h = torch.full((cfg.intermediate_size,), float("nan"), dtype=dtype, device=DEVICE)
        fused.norm_gate_up_silu(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps,
                                layer.mlp.gate_up_proj.weight, layer.mlp.gate_up_proj.bias, h, config=c)
        assert _rel(h, ref_h) < TOL[dtype], c


@pytest.mark.parametrize("cfg,pair", [((8, 64, 1, 4, 8), False), ((4, 32, 0, 4, 2), False),
                                      ((2, 32, 0, 4, 8), True), ((2, 64, 1, 4, 4), True)]
                         + ([((4, 1024, 1, 4, 8), False), ((4, 512, 1, 8, 8), True)] if DEVICE == "cuda" else []))
def test_each_row_of_a_packed_launch_is_the_one_row_launch_bit_for_bit(cfg, pair):
    """A packed block shape (its fifth element: columns a group's one accumulator sums, fused._fma) keeps the
    verify's promise: row r of an R-row launch equals a one-row launch over row r, bit for bit, in each of the
    four CUDA-core kernels; and the one-row launch matches the PyTorch step."""
    dtype = DTYPES[-1]
    cfg_m = _config(bias=True, tied=False)
    model = _model(cfg_m, dtype, seed=5)
    layer = model.layers[0]
    rows = 3 if DEVICE == "cpu" else fused.MAX_ROWS
    x = torch.randn(rows, cfg_m.hidden_size, device=DEVICE).to(dtype)
    a = torch.randn(rows, cfg_m.q_size, device=DEVICE).to(dtype)
    ln, eps = layer.post_attention_layernorm.weight, cfg_m.rms_norm_eps
    if pair:
        w, b, n_out = layer.mlp.gate_up_proj.weight, layer.mlp.gate_up_proj.bias, cfg_m.intermediate_size
        run = lambda xs, out: fused.norm_gate_up_silu(xs, ln, eps, w, b, out, config=cfg)  # noqa: E731
        with torch.no_grad():
            gate, up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(x)).split(n_out, dim=-1)
            ref = torch.nn.functional.silu(gate) * up
        many = torch.full((rows, n_out), float("nan"), dtype=dtype, device=DEVICE)
    else:
        w, n_out = model.lm_head.weight, cfg_m.vocab_size
        run = lambda xs, out: fused.norm_gemv(xs, model.norm.weight, eps, w, out, config=cfg)  # noqa: E731
        with torch.no_grad():
            ref = model.lm_head(model.norm(x)).float()
        many = torch.full((rows, n_out), float("nan"), device=DEVICE)
    run(x, many)
    for r in range(rows):
        one = torch.full_like(many[r], float("nan"))
        run(x[r], one)
        assert torch.equal(many[r], one), (cfg, r)
        assert _rel(one, ref[r]) < TOL[dtype], (cfg, r)
    if not pair:  # the residual GEMV (o_proj / down_proj) too
        res = x.clone()
        fused.gemv_residual(a, layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, res, config=cfg)
        for r in range(rows):
            one = x[r].clone()
            fused.gemv_residual(a[r], layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, one, config=cfg)
            assert torch.equal(res[r], one), (cfg, r)


# The tensor-core family's block shapes the tests run: (rows or pairs, K per iteration, stages, warps); K-blocks
# smaller and larger than the test's K (64). CPU: two (the interpreter).
# On a GPU two more, small enough for float32's shared memory in the two-row-set kernels (stages x tiles: an
# explicit block shape is not filtered by what the device can run, as a picked one is).
DOT_SINGLE = [(16, 32, 2, 4), (16, 128, 3, 4)] + ([(32, 64, 3, 4), (64, 64, 4, 8)] if DEVICE == "cuda" else [])
DOT_PAIRS = [(16, 16, 2, 4), (16, 128, 2, 4)] + ([(32, 64, 3, 4), (32, 64, 4, 8)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_tensor_core_kernels_match_the_step(dtype, bias):
    """models/fused_dot.py: rms_rows + each projection against the model's own modules (one row and three rows:
    the rows past R of the 16 a launch computes are never written), every block shape above."""
    cfg = _config(bias, tied=False)
    model = _model(cfg, dtype, seed=14)
    layer = model.layers[0]
    s, d, rows, pos = 40, cfg.head_dim, 3, 29
    cos, sin = rope_tables(cfg.rope, d, s, dtype, DEVICE)
    x = torch.randn(rows, cfg.hidden_size, device=DEVICE).to(dtype)
    a = torch.randn(rows, cfg.q_size, device=DEVICE).to(dtype)
    with torch.no_grad():
        normed = layer.input_layernorm(x)
        qkv = layer.self_attn.qkv_proj(normed).view(rows, cfg.num_heads + 2 * cfg.num_kv_heads, d)
        qk = apply_rope(qkv[:, : cfg.num_heads + cfg.num_kv_heads], cos[pos:pos + rows], sin[pos:pos + rows])
        ref_res = x + layer.self_attn.o_proj(a)
        gate, up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(x)).split(cfg.intermediate_size, dim=-1)
        ref_h = torch.nn.functional.silu(gate) * up
        ref_logits = model.lm_head(model.norm(x)).float()
    xn = torch.empty_like(x)
    fused_dot.rms_rows(x, layer.input_layernorm.weight, cfg.rms_norm_eps, xn)
    assert _rel(xn, normed) < TOL[dtype]
    for r in (1, rows):
        for c in DOT_PAIRS if bias else DOT_SINGLE:
            kc = torch.full((s, cfg.num_kv_heads, d), float("nan"), dtype=dtype, device=DEVICE)
            vc = kc.clone()
            q = torch.full((r, cfg.q_size), float("nan"), dtype=dtype, device=DEVICE)
            fused_dot.qkv_rope(xn[:r], layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias, cos, sin,
                               torch.tensor([pos], device=DEVICE), q, kc, vc, cfg.num_heads, cfg.num_kv_heads, d,
                               config=c)
            assert _rel(q.view(r, cfg.num_heads, d), qk[:r, : cfg.num_heads]) < TOL[dtype], c
            assert _rel(kc[pos:pos + r], qk[:r, cfg.num_heads:]) < TOL[dtype], c
            assert _rel(vc[pos:pos + r], qkv[:r, cfg.num_heads + cfg.num_kv_heads:]) < TOL[dtype], c
            written = torch.zeros(s, dtype=torch.bool)
            written[pos:pos + r] = True
            assert torch.isnan(kc[~written]).all() and torch.isnan(vc[~written]).all()
            h = torch.full((r, cfg.intermediate_size), float("nan"), dtype=dtype, device=DEVICE)
            xn2 = torch.empty_like(x[:r])
            fused_dot.rms_rows(x[:r], layer.post_attention_layernorm.weight, cfg.rms_norm_eps, xn2)
            fused_dot.gate_up_silu(xn2, layer.mlp.gate_up_proj.weight, layer.mlp.gate_up_proj.bias, h, config=c)
            assert _rel(h, ref_h[:r]) < TOL[dtype], c
        for c in DOT_SINGLE if bias else DOT_PAIRS[:1]:
            res = x[:r].clone()
            fused_dot.gemv_residual(a[:r], layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, res, config=c)
            assert _rel(res, ref_res[:r]) < TOL[dtype], c
            # the norm tail: the same residual, and the norm rms_rows writes of it (the same sums on CPU; a
            # GPU program of other warps may add them in another order), the ticket back at 0, twice over
            ticket, ln = fused_dot.new_ticket(DEVICE), layer.post_attention_layernorm
            want = torch.empty_like(res)
            fused_dot.rms_rows(res, ln.weight, cfg.rms_norm_eps, want)
            for _ in range(2):
                res2, xn_tail = x[:r].clone(), torch.full_like(res, float("nan"))
                fused_dot.gemv_residual(a[:r], layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, res2,
                                        config=c, norm=(ln.weight, cfg.rms_norm_eps, xn_tail, ticket))
                _sync()
                assert torch.equal(res2, res) and int(ticket) == 0, c
                assert torch.equal(xn_tail, want) if DEVICE == "cpu" else _rel(xn_tail, want) < TOL[dtype], c
            logits = torch.full((r, cfg.vocab_size), float("nan"), device=DEVICE)
            xn3 = torch.empty_like(x[:r])
            fused_dot.rms_rows(x[:r], model.norm.weight, cfg.rms_norm_eps, xn3)
            fused_dot.gemv(xn3, model.lm_head.weight, logits, config=c)
            assert _rel(logits, ref_logits[:r]) < TOL[dtype], c


@pytest.mark.skipif(DEVICE != "cuda", reason="a race between programs needs a GPU's programs running at once")
@pytest.mark.parametrize("cfg", [(16, 256, 5, 4), (64, 128, 5, 8)])
def test_the_norm_tail_reads_every_programs_residual_launch_after_launch(cfg):
    """The norm tail at the 8B's o_proj shape (256 or 64 programs running at once): the last program to finish
    reads the residual rows every other program wrote (the ticket's barrier, acquire-release atomic and reads
    past the L1). 100 launches queued back to back (with PDL, each waits for the one before it), each on its own
    residual: every one's norm is the first one's bits and within rounding of rms_rows over its residual, and
    the ticket is back at 0. A program that read a row before its writer's store landed would leave a stale
    value in one launch's norm."""
    n = k = 4096
    rows, launches = 5, 100
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    w = (0.02 * torch.randn(n, k, device=DEVICE, generator=gen)).to(torch.bfloat16)
    a = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    nw = (1.0 + 0.1 * torch.randn(n, device=DEVICE, generator=gen)).to(torch.bfloat16)
    base = torch.randn(rows, n, device=DEVICE, generator=gen).to(torch.bfloat16)
    res = [base.clone() for _ in range(launches)]
    xn = [torch.full_like(base, float("nan")) for _ in range(launches)]
    ticket = fused_dot.new_ticket(DEVICE)
    for i in range(launches):
        fused_dot.gemv_residual(a, w, None, res[i], config=cfg, norm=(nw, 1e-5, xn[i], ticket))
    _sync()
    assert int(ticket) == 0
    want = torch.empty_like(base)
    fused_dot.rms_rows(res[0], nw, 1e-5, want)
    assert _rel(xn[0], want) < TOL[torch.bfloat16]
    for i in range(1, launches):
        assert torch.equal(res[i], res[0]) and torch.equal(xn[i], xn[0]), i


def test_the_gemv_family_is_the_engines_choice():
    """auto: the CUDA-core kernels for every model (the tensor-core one-row step costs 4 % more at the 8B shape:
    a speculating node would be slower than a plain one on text that never repeats); an explicit choice wins;
    anything else is refused by name."""
    assert gemv_family() == "cuda-core" and gemv_family("auto") == "cuda-core"
    assert gemv_family("cuda-core") == "cuda-core" and gemv_family("tensor-core") == "tensor-core"
    with pytest.raises(ValueError, match="lean_gemv 'tensorcore'"):
        gemv_family("tensorcore")


def _lean_case(bias: bool, tied: bool, dtype, seed: int, s: int):
    """(cfg, model, cos, sin, k, v): the test model, its RoPE tables for s positions and random K/V caches
    [layers, s, kv heads, head_dim] in dtype."""
    cfg = _config(bias, tied)
    model = _model(cfg, dtype, seed=seed)
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, s, dtype, DEVICE)
    shape = (cfg.num_layers, s, cfg.num_kv_heads, cfg.head_dim)
    k = torch.randn(shape, device=DEVICE).to(dtype)
    v = torch.randn(shape, device=DEVICE).to(dtype)
    return cfg, model, cos, sin, k, v


# CPU (CI): one case (the kernels' no-bias variants are covered above); the interpreter takes seconds per step.
@pytest.mark.parametrize("gemv,norm,l2", [("cuda-core", "kernel", False), ("tensor-core", "kernel", False),
                                         ("tensor-core", "tail", False), ("tensor-core", "tail", True)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,tied", [(True, True)] + ([(False, False)] if DEVICE == "cuda" else []))
def test_lean_step_matches_the_transformer(dtype, bias, tied, gemv, norm, l2):
    cfg, model, cos, sin, k, v = _lean_case(bias, tied, dtype, seed=3, s=48)
    k_ref, v_ref = k.clone(), v.clone()
    pos, token = 37, torch.tensor([11], device=DEVICE)
    start = torch.tensor([pos], device=DEVICE)
    with torch.no_grad():
        ctx = StepContext(AttentionKind.SPLIT_KV, start)
        ref = model(token, start, cos[pos:pos + 1], sin[pos:pos + 1], list(k_ref.unbind(0)), list(v_ref.unbind(0)),
                    ctx, num_logits=1)
        lean = LeanStep(model, cos, sin, list(k.unbind(0)), list(v.unbind(0)), gemv=gemv)
        lean.set_norm(norm)
        lean.set_l2_prefetch(l2)  # compiled out where PDL is off (the CPU's interpreter); on a GPU it runs
        out = lean.forward(token, start)
    assert lean.gemv == gemv and lean.norm == norm and lean.l2_prefetch == l2
    assert out.shape == ref.shape == (1, cfg.vocab_size)
    assert _rel(out, ref) < STEP_TOL[dtype]
    assert _rel(k, k_ref) < STEP_TOL[dtype] and _rel(v, v_ref) < STEP_TOL[dtype]
    assert torch.equal(k[:, :pos], k_ref[:, :pos]) and torch.equal(k[:, pos + 1:], k_ref[:, pos + 1:])
    if dtype == torch.float32:
        assert int(out.argmax()) == int(ref.argmax())


def test_lean_step_refuses_qk_norm_models():
    cfg = ModelConfig(model_type="qwen3", vocab_size=32, hidden_size=32, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=32,
                      tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True)
    model = Transformer(cfg)
    with pytest.raises(ValueError, match="q/k RMSNorm"):
        LeanStep(model, torch.zeros(4, 16), torch.zeros(4, 16), [], [])


def test_runner_refuses_lean_where_it_does_not_apply():
    from expresslane.engine.decode import DecodeEngine

    model = _model(_config(bias=False, tied=False), torch.float32, seed=4).cpu()
    engine = DecodeEngine(model, model.config, dtype=torch.float32, device=torch.device("cpu"), max_seq_len=32,
                          attention="live", speculation=None)
    assert not engine.runner.lean and engine.runner.mode.value == "eager"  # the CPU path is unchanged
    with pytest.raises(ValueError, match="CUDA graph"):
        engine.runner.set_lean(True)
    # the lean step's options name themselves where there is no lean step (the bench's --verify-attention etc.)
    options = (("set_verify_attention", "shared", "verify attention"), ("set_lean_norm", "tail", "norm placement"),
               ("set_lean_l2_prefetch", True, "L2 prefetch"))
    for setter, value, what in options:
        with pytest.raises(ValueError, match=f"the {what} is the lean step's: no lean step here"):
            getattr(engine.runner, setter)(value)
    assert (engine.runner.verify_attention, engine.runner.lean_norm, engine.runner.lean_l2_prefetch) == (None,) * 3


@pytest.mark.skipif(DEVICE != "cuda", reason="the lean step runs as a CUDA graph: needs a CUDA device")
@pytest.mark.parametrize("bias,tied", [(False, False), (True, True)])
def test_lean_graph_decodes_like_the_eager_step(bias, tied):
    from expresslane.engine.decode import DecodeEngine, SamplingParams

    model = _model(_config(bias, tied), torch.float32, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # large top-1 margins: summation order cannot flip the argmax
    kw = dict(dtype=torch.float32, device=torch.device("cuda"), max_seq_len=64, speculation=None)
    lean = DecodeEngine(model, model.config, attention="split", **kw)
    eager = DecodeEngine(model, model.config, attention="split", cuda_graph=False, **kw)
    assert lean.runner.lean and lean.runner.mode.value == "lean-graph" and not eager.runner.lean
    prompt = [3, 17, 42, 5, 9, 60, 2, 33]
    outs = []
    for engine in (lean, eager):
        first = int(engine.prefill(prompt).argmax())
        outs.append(list(engine.generate(first, len(prompt), SamplingParams(max_tokens=40, ignore_eos=True))))
    assert outs[0] == outs[1]


def test_bf16_rounding_on_the_bits_is_round_to_nearest_even():
    """fused._rounded rounds float32 to bf16 on the bits (so the compiler cannot fuse RoPE's product and sum
    into one bf16 FMA): it must agree with torch's float32 -> bf16 cast, ties included."""
    import triton
    import triton.language as tl

    @triton.jit
    def _round_kernel(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, fused._rounded(tl.load(x_ptr + offs), tl.bfloat16))

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1024, generator=gen) * torch.logspace(-20, 20, 1024)
    ties = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8), 3.0, 0.0, -0.0] * 4)
    x = torch.cat([x[: 1024 - ties.numel()], ties]).to(DEVICE)
    out = torch.empty_like(x)
    _round_kernel[(1,)](x, out, N=1024)
    assert torch.equal(out, x.to(torch.bfloat16).float())


def test_pdl_is_off_where_it_cannot_run():
    """Programmatic dependent launch (models/pdl.py) only on a CUDA device of capability 9+ with a Triton that
    launches with it; off those (this CPU run, the interpreter) it says why and the kernels run without it."""
    from expresslane.engine.models import pdl

    cpu = torch.device("cpu")
    assert "CUDA device" in pdl.pdl_unsupported_reason(cpu)
    assert pdl.use_pdl(cpu) is False
    assert pdl.parse_kinds("1") == frozenset(pdl.DEFAULT_KINDS) and pdl.parse_kinds("0") == frozenset()
    assert pdl.parse_kinds(" gemv, attn_merge ") == {"gemv", "attn_merge"}
    with pytest.raises(ValueError, match="unknown kernel kinds"):
        pdl.parse_kinds("gemv,attention")
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9:
        assert pdl.pdl_unsupported_reason(torch.device("cuda")) is None, "PDL should run on this GPU"


@pytest.mark.skipif(DEVICE != "cuda", reason="PDL and the lean graph need a CUDA device")
def test_pdl_changes_no_bit_of_the_lean_graphs_tokens_or_logits():
    """The lean step's graph captured with PDL and without: the same kernels in the same summation order, only
    launched to overlap, so every step's logits must be bit-identical (a kernel reading its input before the
    kernel that writes it has finished shows up as a difference, or as two replays that differ). A bf16 model
    wide enough that each GEMV runs several waves of programs."""
    from expresslane.engine.decode import DecodeEngine, SamplingParams
    from expresslane.engine.models import pdl

    if pdl.pdl_unsupported_reason(torch.device("cuda")):
        pytest.skip(pdl.pdl_unsupported_reason(torch.device("cuda")))
    cfg = ModelConfig(model_type="llama", vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=4,
                      num_heads=16, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=512,
                      tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    model = _model(cfg, torch.bfloat16, seed=8)
    prompt = list(range(5, 5 + 37))
    runs = {}
    default = pdl.pdl_kinds()
    try:
        for on in (True, False):
            pdl.set_pdl(on)
            engine = DecodeEngine(model, cfg, dtype=torch.bfloat16, device=torch.device("cuda"), max_seq_len=256,
                                  attention="split", speculation=None)
            assert engine.runner.lean
            if not on:  # the block shapes PDL's run picked: the same summation order in both runs
                for key, cfg_picked in list(fused._PICKED.items()):  # (name, n, k, rows, device, pdl, dtype)
                    if key[5]:
                        fused._PICKED[key[:5] + (False,) + key[6:]] = cfg_picked
            engine.warmup()
            first = int(engine.prefill(prompt).argmax())
            tokens = [first, *engine.generate(first, len(prompt), SamplingParams(max_tokens=64, ignore_eos=True))]
            steps = []
            with torch.inference_mode():
                for pos in (40, 41, 100):  # rows below pos were written by the generation
                    for _ in range(3):  # replays of one step must agree with each other too
                        steps.append(engine.runner.forward(torch.tensor([tokens[1]], device="cuda"), pos).clone())
            runs[on] = (tokens, steps)
            del engine
    finally:
        pdl.set_pdl(default)
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a, b)


# CPU: one block shape (32 rows a program: the copies fall inside the winner's program and in others).
# The tensor-core family: 16 rows a program.
@pytest.mark.parametrize("gemv,cfg_pick", [("cuda-core", (32, 16, 1)), ("tensor-core", (16, 16, 2, 4))]
                         + ([("cuda-core", (4, 2048, 0)), ("tensor-core", (64, 128, 5, 8))] if DEVICE == "cuda" else []))
def test_the_greedy_steps_argmax_is_torchs_first_maximum(gemv, cfg_pick):
    """LeanStep.forward(greedy=True): each lm_head program writes its best (value, first row) as one int64 key
    and greedy_advance writes the row of the largest as the next token and start + 1. It
    must be torch.argmax of the same logits, ties included (bf16-rounded logits tie often over a large
    vocabulary): copies of the winning lm_head row before and after it, inside one program's rows and in
    other programs, must give the first copy."""
    cfg, model, cos, sin, k, v = _lean_case(False, False, torch.float32, seed=9, s=48)
    lean = LeanStep(model, cos, sin, list(k.unbind(0)), list(v.unbind(0)), gemv=gemv)
    key = ("norm_gemv" if gemv == "cuda-core" else "dot_gemv", cfg.vocab_size, cfg.hidden_size, 1,
           str(torch.device(DEVICE)), fused.use_pdl(torch.device(DEVICE)), torch.float32)
    saved = fused._PICKED.get(key)
    fused._PICKED[key] = cfg_pick  # the block shape decides which rows share a program
    try:
        pos = 20
        for copies in ((), (-7, 1, 2, 40)):
            with torch.no_grad():
                tokens, start = torch.tensor([11], device=DEVICE), torch.tensor([pos], device=DEVICE)
                ref = lean.forward(tokens, start).clone()
                best = int(ref.argmax())
                for d in copies:
                    j = best + d
                    if 0 <= j < cfg.vocab_size:
                        model.lm_head.weight[j] = model.lm_head.weight[best]
                k[:, pos].zero_()  # the same cache row as the reference step saw
                v[:, pos].zero_()
                ref = lean.forward(tokens, start).clone()
                out = lean.forward(tokens, start, greedy=True)
            assert torch.equal(out, ref)
            want = int(ref.argmax())
            if copies:  # the copies tie with the winner exactly (the same row, the same summation order)
                assert int((ref[0] == ref[0, want]).sum()) > 1 and want < best
            assert int(tokens[0]) == want, (copies, int(tokens[0]), want)
            assert int(start[0]) == pos + 1
            # the step is counted, and the ring slot of its number holds (number, token): pinned memory on a GPU
            seq = int(lean.greedy_seq[0])
            assert seq == (1 if not copies else 2)
            assert lean.token_ring.is_pinned() == (DEVICE == "cuda")
            assert fused.ring_entry(int(lean.token_ring[seq % lean.RING])) == (seq, want)
    finally:
        if saved is None:
            fused._PICKED.pop(key, None)
        else:
            fused._PICKED[key] = saved


def test_a_greedy_warm_up_is_not_a_step():
    """LeanStep.warm_greedy (the runner runs it before capturing the greedy graph) puts back the token, the
    position, the step count and the token ring: the chain reads step n's token from the ring slot of its
    count, so a counted warm-up made it read every token one step late (seen on the H200, run 7: a token
    repeated at index 2 wherever the greedy graph was captured lazily inside a chain)."""
    cfg = _config(bias=False, tied=False)
    model = _model(cfg, torch.float32, seed=10)
    s = 32
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, s, torch.float32, DEVICE)
    shape = (cfg.num_layers, s, cfg.num_kv_heads, cfg.head_dim)
    lean = LeanStep(model, cos, sin, list(torch.randn(shape, device=DEVICE).unbind(0)),
                    list(torch.randn(shape, device=DEVICE).unbind(0)))
    with torch.no_grad():
        tokens, start = torch.tensor([5], device=DEVICE), torch.tensor([9], device=DEVICE)
        lean.forward(tokens.clone(), start.clone(), greedy=True)  # one real step: count 1, a ring slot written
        _sync()  # on a GPU the ring is host memory the kernel writes: read it once the step has run
        state = [t.clone() for t in (lean.greedy_seq, lean.token_ring)]
        lean.warm_greedy(tokens, start)
        _sync()  # a warm-up kernel that landed after warm_greedy's restore would show now
    assert int(tokens[0]) == 5 and int(start[0]) == 9
    assert torch.equal(lean.greedy_seq, state[0]) and int(lean.greedy_seq[0]) == 1
    assert torch.equal(lean.token_ring, state[1])


# The row-invariant verify (models/lean.py): R rows in one step, row r bit-identical to the T = 1 step at
# start + r. On CPU (the interpreter) float32 and one row count per case; on a GPU bf16 too, every row count,
# and positions on both sides of the split-KV attention's chunk boundaries (a row's splits are those of its own
# length, not the verify's).
VERIFY_CASES = ([(torch.float32, 3, 37)] if DEVICE == "cpu" else
                [(dt, r, pos) for dt in DTYPES for r in range(2, fused.MAX_ROWS + 1) for pos in (37, 63, 64, 126)])


@pytest.mark.parametrize("gemv,attn,norm", [("tensor-core", "per-row", "kernel"), ("tensor-core", "per-row", "tail"),
                                             ("cuda-core", "per-row", "kernel"), ("cuda-core", "shared", "kernel")]
                         + ([("tensor-core", "shared", "kernel"), ("tensor-core", "shared", "tail")]
                            if DEVICE == "cuda" else []))
@pytest.mark.parametrize("dtype,rows,pos", VERIFY_CASES)
@pytest.mark.parametrize("bias,tied", [(True, True)] + ([(False, False)] if DEVICE == "cuda" else []))
def test_each_verify_row_is_the_one_row_step_bit_for_bit(dtype, rows, pos, bias, tied, gemv, attn, norm):
    """attn: the verify's attention (models/lean.py VERIFY_ATTENTION); the one-row step is the same either way.
    norm: where the tensor-core family's norms run (LEAN_NORMS), the same for the verify and the one-row step."""
    cfg, model, cos, sin, k, v = _lean_case(bias, tied, dtype, seed=11, s=160)
    k1, v1 = k.clone(), v.clone()
    tokens = torch.tensor([11, 3, 90, 42, 7][:rows], device=DEVICE)
    with torch.no_grad():
        lean = LeanStep(model, cos, sin, list(k.unbind(0)), list(v.unbind(0)), max_rows=fused.MAX_ROWS, gemv=gemv)
        lean.set_verify_attention(attn)
        lean.set_norm(norm)
        verify = lean.forward(tokens, torch.tensor([pos], device=DEVICE)).clone()
        # the one-row step of a lean step built for the same rows (the engine's: one block shape for every row
        # count), on a cache of its own
        one = LeanStep(model, cos, sin, list(k1.unbind(0)), list(v1.unbind(0)), max_rows=fused.MAX_ROWS, gemv=gemv)
        one.set_norm(norm)
        steps = [one.forward(tokens[r:r + 1], torch.tensor([pos + r], device=DEVICE)).clone() for r in range(rows)]
    _sync()
    assert verify.shape == (rows, cfg.vocab_size)
    for r in range(rows):
        assert torch.equal(verify[r], steps[r][0]), (r, _rel(verify[r], steps[r][0]))
    assert torch.equal(k, k1) and torch.equal(v, v1)  # the same K/V rows start .. start + R - 1, nothing else


# Several users' rows in one step (decode/batch.py on a GPU): the tensor-core family's forward_seats. Each row
# of a sequence in its seat is the bits of that sequence's own one-row step (a lean step over that seat alone),
# whatever the other rows: seats at other lengths, a verify's rows beside plain ones, rows in any order. On CPU
# (the interpreter) one float32 case; on a GPU bf16 too, lengths on both sides of the attention's chunk bounds.
SEAT_CASES = ([(torch.float32, (37, 9, 60))] if DEVICE == "cpu" else
              [(dt, lens) for dt in DTYPES for lens in ((37, 9, 60), (63, 64, 126), (1, 127, 64))])


@pytest.mark.parametrize("dtype,lens", SEAT_CASES)
@pytest.mark.parametrize("bias,tied", [(True, True)] + ([(False, False)] if DEVICE == "cuda" else []))
def test_rows_of_several_seats_are_each_seats_own_steps_bit_for_bit(dtype, lens, bias, tied):
    seats, s = 3, 160
    cfg, model, cos, sin, k, v = _lean_case(bias, tied, dtype, seed=13, s=seats * s)
    k1, v1 = k.clone(), v.clone()
    # (seat, first position, tokens): seat 2 a verify of three rows, seat 0 one row, seat 1 two rows
    plan = [(2, lens[2], [5, 17, 80]), (0, lens[0], [11]), (1, lens[1], [3, 90])]
    tokens = torch.tensor([t for _, _, toks in plan for t in toks], device=DEVICE)
    rows = torch.zeros(2 * fused_dot.RP, dtype=torch.long, device=DEVICE)
    i = 0
    for seat, start, toks in plan:
        for j in range(len(toks)):
            rows[i] = start + j
            rows[fused_dot.RP + i] = seat * s + start + j
            i += 1
    with torch.no_grad():
        lean = LeanStep(model, cos, sin, list(k.unbind(0)), list(v.unbind(0)), max_rows=fused.MAX_ROWS,
                        gemv="tensor-core", seat_rows=8)
        together = lean.forward_seats(tokens, rows).clone()
        alone = []
        for seat, start, toks in plan:  # each seat's sequence alone: a lean step over its own rows of the cache
            ks = [kk[seat * s:(seat + 1) * s] for kk in k1.unbind(0)]
            vs = [vv[seat * s:(seat + 1) * s] for vv in v1.unbind(0)]
            one = LeanStep(model, cos, sin, ks, vs, max_rows=fused.MAX_ROWS, gemv="tensor-core")
            alone += [one.forward(torch.tensor([t], device=DEVICE), torch.tensor([start + j], device=DEVICE))[0]
                      .clone() for j, t in enumerate(toks)]
    _sync()
    assert together.shape == (len(alone), cfg.vocab_size)
    for r in range(len(alone)):
        assert torch.equal(together[r], alone[r]), (r, _rel(together[r], alone[r]))
    assert torch.equal(k, k1) and torch.equal(v, v1)  # the same K/V rows, each in its own seat, nothing else


def test_seat_rows_need_the_tensor_core_family():
    cfg, model, cos, sin, k, v = _lean_case(False, False, torch.float32, seed=1, s=8)
    with pytest.raises(ValueError, match="tensor-core"):
        LeanStep(model, cos, sin, list(k.unbind(0)), list(v.unbind(0)), gemv="cuda-core", seat_rows=4)
    with pytest.raises(ValueError, match="1..16"):
        LeanStep(model, cos, sin, list(k.unbind(0)), list(v.unbind(0)), gemv="tensor-core", seat_rows=17)


def test_a_pick_is_kept_per_weight_dtype():
    """A float32 kernel's pipeline stages take twice the shared memory of a bf16 one's: a block shape picked for
    bf16 weights of one (kernel, N, K) must not serve float32 weights of the same shape (on the H100 a float32
    tensor-core residual kernel with the bf16 pick asked for 245,760 bytes of the 232,448 there: OutOfResources,
    2026-12-05). Each dtype is picked from its own candidates here (off a GPU the first that fits)."""
    name, n, k = "test_pick_per_dtype", 64, 4096
    try:
        got = [fused.pick_config(name, n, k, [cands], lambda c: None, dtype=dtype)
               for cands, dtype in (((4, 2048, 0), torch.bfloat16), ((8, 512, 1), torch.float32))]
        assert got == [(4, 2048, 0), (8, 512, 1)]
        assert fused.picked_config(name, n, k, 1, None, torch.float32) == (8, 512, 1)
        assert fused.picked_config(name, n, k, 1, None, torch.float16) is None
    finally:
        for key in [key for key in fused._PICKED if key[0] == name]:
            del fused._PICKED[key]


def test_a_verifying_step_keeps_only_the_block_shapes_that_do_not_spill():
    """pick_config(rows > 1) times only the candidates whose rows-row kernel spills the fewest bytes (none,
    wherever one spills none); with every candidate spilling, the least spilling ones."""
    spilled = {(4, 2048, 0): 4608, (8, 512, 1, 8): 0, (16, 256, 1, 8): 0, (8, 1024, 0): 2560}
    kept, seen = fused.least_spilling(list(spilled), spilled.__getitem__)
    assert kept == [(8, 512, 1, 8), (16, 256, 1, 8)] and seen == spilled
    some = {(4, 2048, 0): 4608, (8, 1024, 0): 2560, (16, 512, 0): 2560}
    assert fused.least_spilling(list(some), some.__getitem__)[0] == [(8, 1024, 0), (16, 512, 0)]


def test_a_verifying_step_picks_the_fastest_verify_among_the_fastest_one_row_shapes():
    """fused.verify_pick: the shapes within ONE_ROW_SLACK (2 %) of the fastest one-row time are timed at the
    step's rows (twice each, the better kept), and the fastest there is the pick; a shape slower at one row is
    never timed, however fast its verify; alone within the slack, the fastest one-row shape with no timing."""
    one_row = {(4, 1024, 1): 10.0, (4, 1024, 1, 4, 8): 10.15, (8, 512, 1, 4, 8): 10.3, (16, 512, 0): 12.0}
    rows_times = {(4, 1024, 1): [25.0, 24.0], (4, 1024, 1, 4, 8): [13.0, 12.5], (8, 512, 1, 4, 8): [9.0, 9.0],
                  (16, 512, 0): [5.0, 5.0]}
    calls = []

    def time_rows(cfg):
        calls.append(cfg)
        return rows_times[cfg][sum(c == cfg for c in calls) - 1]
    best, seen = fused.verify_pick(one_row, time_rows)
    assert best == (4, 1024, 1, 4, 8) and seen == {(4, 1024, 1): 24.0, (4, 1024, 1, 4, 8): 12.5}
    assert sorted(calls) == sorted([(4, 1024, 1), (4, 1024, 1, 4, 8)] * 2)
    calls.clear()
    assert fused.verify_pick({(4, 1024, 1): 10.0, (16, 512, 0): 12.0}, time_rows) == ((4, 1024, 1), {})
    assert calls == []


@pytest.mark.skipif(DEVICE != "cuda", reason="ptxas's spill count: a compiled CUDA kernel")
def test_the_lean_steps_picks_for_a_verify_of_five_rows_do_not_spill():
    """A lean step built for five rows picks, for every kernel, a block shape whose five-row kernel spills no
    more than any other candidate's (on the H200: none), and the launch of one row uses that same shape."""
    cfg = _config(bias=False, tied=False)
    model = _model(cfg, torch.bfloat16, seed=13)
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, 64, torch.bfloat16, DEVICE)
    shape = (cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim)
    kv = [torch.zeros(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    fused.TUNING_LOG.clear()
    saved = dict(fused._PICKED)
    fused._PICKED.clear()  # picked afresh, not taken from an earlier test's step
    try:
        with torch.no_grad():
            lean = LeanStep(model, cos, sin, list(kv[0].unbind(0)), list(kv[1].unbind(0)), max_rows=fused.MAX_ROWS,
                            gemv="cuda-core")
            lean.forward(torch.tensor([1], device=DEVICE), torch.tensor([3], device=DEVICE))
    finally:
        fused._PICKED.clear()
        fused._PICKED.update(saved)
    picks = [e for e in fused.TUNING_LOG if e["rows"] == fused.MAX_ROWS]
    assert {e["kernel"] for e in picks} >= {"gemv_residual", "norm_gate_up_silu", "norm_gemv", "norm_qkv_rope"}
    for e in picks:
        best = fused._label(tuple(e["best"]))
        assert e["spilled"][best] == min(e["spilled"].values()), e
        assert set(e["us"]) == {c for c, b in e["spilled"].items() if b == e["spilled"][best]}, e
        # the verify-aware pick: the fastest five-row time of the shapes within the slack at one row
        fastest = min(e["us"].values())
        assert e["us"][best] <= fastest * (1 + fused.ONE_ROW_SLACK) + 0.01, e
        if e["us_rows"]:
            assert best == min(e["us_rows"], key=e["us_rows"].get), e


@pytest.mark.skipif(DEVICE != "cuda", reason="the block-shape picker compiles and times only on a GPU")
@pytest.mark.parametrize("gemv", ["cuda-core", "tensor-core"])
def test_the_picker_compiles_every_kernel_it_loads_in_parallel_first(gemv):
    """A lean step built for a verify of five rows compiles, for each kernel it picks a block shape for, every
    kernel the pick loads (the candidates' five-row kernels for their spills, their one-row kernels for the
    timing, the picked shape's kernels of 2 .. 4 rows for the verify's graphs) in models/precompile.py's batches,
    on its thread pool: no kernel of theirs is compiled one at a time at a launch, in the pick or after it."""
    import triton
    from triton.runtime import _async_compile

    from expresslane.engine.models import precompile

    if precompile.threads() < 2:
        pytest.skip("one compile thread on this host (or a Triton without AsyncCompileMode)")
    picked = ({"_norm_qkv_rope_kernel", "_gemv_residual_kernel", "_norm_gate_up_silu_kernel", "_norm_gemv_kernel"}
              if gemv == "cuda-core" else
              {"_qkv_rope_kernel", "_gemv_residual_kernel", "_gate_up_silu_kernel", "_gemv_kernel"})
    module = fused if gemv == "cuda-core" else fused_dot
    kernels = [getattr(module, name) for name in picked]
    compiles = []

    def hook(*args, fn=None, **kwargs):  # Triton calls it before each compile, on the thread that asks for it
        if getattr(fn, "jit_function", None) in kernels:
            compiles.append((fn.name, _async_compile.active_mode.get() is not None))
        return False

    cfg = _config(bias=False, tied=False)
    model = _model(cfg, torch.bfloat16, seed=14)
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, 64, torch.bfloat16, DEVICE)
    shape = (cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim)
    kv = [torch.zeros(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    if not all(hasattr(k, "device_caches") for k in kernels) or not hasattr(triton.knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no per-device kernel cache or compile hook to watch")
    saved = dict(fused._PICKED)
    fused._PICKED.clear()  # picked afresh
    for k in kernels:
        k.device_caches.clear()  # and compiled afresh (Triton's disk cache may still answer: the hook sees it)
    jobs = precompile.STATS.jobs
    old_hook = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        with torch.no_grad():
            lean = LeanStep(model, cos, sin, list(kv[0].unbind(0)), list(kv[1].unbind(0)), max_rows=fused.MAX_ROWS,
                            gemv=gemv)
            lean.forward(torch.tensor([1], device=DEVICE), torch.tensor([3], device=DEVICE))
            for rows in range(2, fused.MAX_ROWS + 1):  # the verify's launches: compiled already
                lean.forward(torch.arange(rows, device=DEVICE), torch.tensor([4], device=DEVICE))
        _sync()
    finally:
        triton.knobs.runtime.jit_cache_hook = old_hook
        fused._PICKED.clear()
        fused._PICKED.update(saved)
    assert precompile.STATS.jobs > jobs
    assert {name.rsplit(".", 1)[-1] for name, _ in compiles} == picked, compiles
    late = [name for name, batched in compiles if not batched]
    assert not late, f"compiled one at a time, outside the parallel batches: {late}"


def test_the_lean_step_refuses_more_rows_than_it_was_built_for():
    cfg = _config(bias=False, tied=False)
    model = _model(cfg, torch.float32, seed=12)
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, 16, torch.float32, DEVICE)
    shape = (cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    lean = LeanStep(model, cos, sin, list(torch.zeros(shape, device=DEVICE).unbind(0)),
                    list(torch.zeros(shape, device=DEVICE).unbind(0)), max_rows=2)
    with pytest.raises(ValueError, match="takes 1..2 rows"):
        lean.forward(torch.tensor([1, 2, 3], device=DEVICE), torch.tensor([0], device=DEVICE))
    with pytest.raises(ValueError, match="takes 1..5 rows"):
        LeanStep(model, cos, sin, [], [], max_rows=fused.MAX_ROWS + 1)
    assert lean.verify_attention == "per-row"
    lean.set_verify_attention("shared")
    assert lean.verify_attention == "shared"
    with pytest.raises(ValueError, match="one of per-row, shared"):
        lean.set_verify_attention("fused")
    assert lean.norm == "kernel"  # the CUDA-core family folds its norms into the projections: no tail
    with pytest.raises(ValueError, match="the norm tail is the tensor-core family's"):
        lean.set_norm("tail")
    with pytest.raises(ValueError, match="one of kernel, tail"):
        lean.set_norm("folded")
    with pytest.raises(ValueError, match="the L2 prefetch is the tensor-core family's"):
        lean.set_l2_prefetch(True)
    lean.set_l2_prefetch(False)
    assert lean.l2_prefetch is False


def test_l2_lines_are_the_prologues_tiles_in_a_power_of_two():
    """fused_dot.l2_lines: the lines of 64 weights in the first STAGES - 1 tiles a row, rounded down to a power of
    two (tl.arange's length), at least one; 0 when off."""
    assert fused_dot.l2_lines((64, 256, 5, 4), True) == 16  # 4 tiles of 4 lines
    assert fused_dot.l2_lines((64, 128, 7, 4), True) == 8  # 6 tiles of 2 lines: 12, rounded down
    assert fused_dot.l2_lines((16, 32, 2, 4), True) == 1  # half a line: one
    assert fused_dot.l2_lines((64, 256, 5, 4), False) == 0
