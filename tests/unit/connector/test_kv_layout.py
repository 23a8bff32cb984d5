"""kv_layout against vLLM's own CPU attention backend: KV written by vLLM's cache-write op, read back dense."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from expresslane.engine.kv_layout import (  # noqa: E402
    PagedKVLayout,
    PageView,
    UnsupportedKVLayout,
    dense_from_paged,
    derive_paged_layout,
    layer_index,
)

NUM_BLOCKS, H, BLOCK, D = 24, 4, 32, 32


def _cpu_backend():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    return CPUAttentionBackend, _get_attn_isa


def _vllm_layer_cache(num_blocks: int, dtype=torch.float32) -> torch.Tensor:
    """A per-layer cache built the way vLLM builds it: create_kv_cache_views over a flat int8 buffer."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=H, head_size=D, dtype=dtype)
    page = spec.page_size_bytes
    raw = torch.zeros(num_blocks * page * 2, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                           layer_stride=num_blocks * page, block_stride=page)
    (backend, _) = _cpu_backend()
    layout = backend.supported_kv_cache_layouts()[0]
    assert layout == KVCacheLayout.LBHNC
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor)


def _write_through_vllm(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Exactly CPUAttentionBackendImpl.do_kv_cache_update."""
    from vllm import _custom_ops as ops

    _, get_isa = _cpu_backend()
    num_blocks, num_kv_heads, block_size, _ = cache.size()
    kv = cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
    key_cache, value_cache = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots,
                                   get_isa(cache.dtype, block_size, D, "auto"),
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


@pytest.mark.parametrize("num_tokens", [1, 31, 32, 77])
def test_cpu_backend_roundtrip_through_vllm_cache_write(num_tokens: int) -> None:
    backend, get_isa = _cpu_backend()
    layers = _vllm_layer_cache(NUM_BLOCKS)
    layout = derive_paged_layout(backend.get_name(), num_kv_heads=H, head_dim=D, head_dim_v=D,
                                 dtype=torch.float32, block_size=BLOCK, layer=layers[0],
                                 cpu_isa=get_isa(torch.float32, BLOCK, D, "auto"))
    # A scattered, non-monotonic block table, as the block pool hands out.
    block_ids = [17, 3, 9][: -(-num_tokens // BLOCK)]
    slots = torch.tensor([block_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(num_tokens)])
    gen = torch.Generator().manual_seed(num_tokens)
    ks = [torch.randn(num_tokens, H, D, generator=gen) for _ in layers]
    vs = [torch.randn(num_tokens, H, D, generator=gen) for _ in layers]
    for layer, k, v in zip(layers, ks, vs):
        layer.view(torch.float32).normal_()  # garbage elsewhere: only the request's slots may be read
        _write_through_vllm(layer, k, v, slots)
    k_dense, v_dense = dense_from_paged(layers, layout, block_ids, num_tokens)
    assert k_dense.shape == (2, num_tokens, H, D)
    blk, off = layout.token_index(block_ids, num_tokens)
    k0, v0 = layout.gather_layer(layers[0], blk, off)  # the allocating path agrees with the out= path
    assert torch.equal(k0, k_dense[0]) and torch.equal(v0, v_dense[0])
    assert torch.equal(k_dense, torch.stack(ks))
    assert torch.equal(v_dense, torch.stack(vs))


def test_wrong_split_is_detected() -> None:
    """The test above can fail: reading a CPU cache with the FLASH_ATTN split gives different KV."""
    backend, _ = _cpu_backend()
    layers = _vllm_layer_cache(NUM_BLOCKS)
    k = torch.randn(40, H, D)
    v = torch.randn(40, H, D)
    slots = torch.arange(40) + 5 * BLOCK
    _write_through_vllm(layers[0], k, v, slots)
    # The naive reading of FACTS.md's "[B, H, N, 2*D]": K || V per token.
    wrong = PagedKVLayout("naive", H, D, torch.float32, BLOCK, BLOCK, PageView(0, None, (D,), None),
                          PageView(D, None, (D,), None))
    k_wrong, _ = dense_from_paged(layers[:1], wrong, [5, 6], 40)
    assert not torch.equal(k_wrong[0], k)


def test_content_split_matches_flash_attn_convention() -> None:
    """FLASH_ATTN/TRITON_ATTN: kv_cache.transpose(1, 2).split(D, -1) -> per token C = K || V."""
    cache = torch.randn(8, H, 16, 2 * D)
    layout = derive_paged_layout("FLASH_ATTN", num_kv_heads=H, head_dim=D, head_dim_v=D, dtype=torch.float32,
                                 block_size=16, layer=cache)
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # [B, N, H, D], the backend's own view
    k, v = dense_from_paged([cache], layout, [6, 2], 20)
    expect_k = torch.cat([key_cache[6], key_cache[2, :4]])
    expect_v = torch.cat([value_cache[6], value_cache[2, :4]])
    assert torch.equal(k[0], expect_k) and torch.equal(v[0], expect_v)


def test_kernel_blocks_smaller_than_manager_blocks() -> None:
    """Manager block b = kernel blocks b*ratio..; tokens stay in order across kernel blocks."""
    cache = torch.randn(16, H, 8, 2 * D)  # 8 manager blocks of 16 tokens = 16 kernel blocks of 8
    layout = derive_paged_layout("FLASH_ATTN", num_kv_heads=H, head_dim=D, head_dim_v=D, dtype=torch.float32,
                                 block_size=16, layer=cache)
    assert layout.ratio == 2
    k, _ = dense_from_paged([cache], layout, [5, 1], 20)
    expect = torch.cat([cache[10, :, :, :D].transpose(0, 1), cache[11, :, :, :D].transpose(0, 1),
                        cache[2, :, :4, :D].transpose(0, 1)])
    assert torch.equal(k[0], expect)


def test_unknown_backend_and_shape_mismatch_refused() -> None:
    cache = torch.zeros(4, H, 16, 2 * D)
    with pytest.raises(UnsupportedKVLayout, match="FLASHINFER"):
        derive_paged_layout("FLASHINFER", num_kv_heads=H, head_dim=D, head_dim_v=D, dtype=torch.float32,
                            block_size=16, layer=cache)
    with pytest.raises(UnsupportedKVLayout):
        derive_paged_layout("FLASH_ATTN", num_kv_heads=H + 1, head_dim=D, head_dim_v=D, dtype=torch.float32,
                            block_size=16, layer=cache)
    with pytest.raises(ValueError):
        PagedKVLayout("x", H, D, torch.float32, 16, 16, PageView(0, None, (D,), None),
                      PageView(D, None, (D,), None)).token_index([1], 17)


def test_layer_index() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(ValueError):
        layer_index("lm_head")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_recovers_an_interleaved_packing(dtype) -> None:
    """A VNNI-style writer (K as [D/2, N, 2] per head, V token-major) is recovered as a strided view."""
    from expresslane.engine.kv_layout import probe_cpu_attn

    n_tok, heads, dim = 16, 2, 8

    def write(key, value, key_cache, value_cache, slots):  # key: [T, H, D]; caches: [1, H, N, D] views
        for t in range(key.shape[0]):
            for h in range(heads):
                kc = key_cache[0, h].reshape(-1)  # the head's K page as N*D elements (contiguous)
                for d in range(dim):
                    kc[(d // 2) * n_tok * 2 + t * 2 + d % 2] = key[t, h, d]
                value_cache[0, h, t] = value[t, h]

    k_view, v_view = probe_cpu_attn(heads, n_tok, dim, dtype, "test", write=write)
    assert k_view.dim_shape == (dim // 2, 2) and v_view.dim_shape == (dim,)
    cache = torch.zeros(3, heads, n_tok, 2 * dim, dtype=dtype)
    key = torch.randn(n_tok, heads, dim).to(dtype)
    value = torch.randn(n_tok, heads, dim).to(dtype)
    kv = cache.view(3, heads, 2 * n_tok, dim)
    kc, vc = kv.chunk(2, dim=2)
    write(key, value, kc[2:3], vc[2:3], None)
    layout = PagedKVLayout("test", heads, dim, dtype, n_tok, n_tok, k_view, v_view)
    k, v = dense_from_paged([cache], layout, [2], n_tok)
    assert torch.equal(k[0], key) and torch.equal(v[0], value)
