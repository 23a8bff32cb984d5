"""Real vLLM objects for connector tests: VllmConfig from a config-only tiny Llama dir, the real Scheduler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

BLOCK = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}
HEADS, HEAD_DIM = 2, 32


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-config")
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return d


def make_vllm_config(model_dir: Path, *, max_num_batched_tokens: int = 64, num_blocks: int = 100,
                     connector: dict | None = None):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    connector = connector or {
        "kv_connector": "ExpressLaneConnector",
        "kv_connector_module_path": "expresslane.engine.connector",
        "kv_role": "kv_producer",
    }
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=1024)
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8,
                                         max_model_len=1024, is_encoder_decoder=False, enable_chunked_prefill=True),
        kv_transfer_config=KVTransferConfig(**connector),
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = num_blocks
    return vc


def make_kv_cache_config(num_blocks: int = 100):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


@pytest.fixture()
def scheduler(model_dir):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc = make_vllm_config(model_dir)
    return Scheduler(vc, make_kv_cache_config(), StructuredOutputManager(vc), block_size=BLOCK, log_stats=True)


def make_request(req_id: str, num_tokens: int, kv_transfer_params: dict | None = None, max_tokens: int = 1):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    return Request(req_id, [(i * 7 + 3) % 1000 for i in range(num_tokens)], sp, None)


def step(sched, sampled: dict[str, int] | None = None):
    """One real schedule() + update_from_output(); every request that finished its prompt samples a token."""
    from vllm.v1.outputs import ModelRunnerOutput

    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    toks = []
    for rid in ids:
        req = sched.requests[rid]
        done = req.num_computed_tokens >= req.num_prompt_tokens  # already advanced by schedule()
        toks.append([(sampled or {}).get(rid, 5)] if done else [])
    outputs = sched.update_from_output(so, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=toks))
    # What the engine hands the API server per finished request: its kv_transfer_params (the HTTP response's)
    finished = getattr(sched, "finished_kv_params", {})
    for eco in outputs.values():
        for out in eco.outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = out.kv_transfer_params
    sched.finished_kv_params = finished
    # What the engine core sends the API server's stat loggers: the connector stats payload of the step
    payloads = getattr(sched, "connector_stats", [])
    for eco in outputs.values():
        if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
            payloads.append(eco.scheduler_stats.kv_connector_stats)
    sched.connector_stats = payloads
    return so


def marker(rid: str = "rid-1", port: int = 5556) -> dict:
    return {"expresslane_host": "127.0.0.1", "expresslane_ctrl_port": port, "expresslane_rid": rid}
