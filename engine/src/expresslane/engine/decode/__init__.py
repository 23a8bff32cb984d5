"""The express decode engine: a static KV cache of one or more seats, KV injected from a prefill server.

API::

    from expresslane.engine.decode import DecodeEngine, SamplingParams

    engine = DecodeEngine.from_pretrained(model_dir, dtype="float32", device="cpu", max_seq_len=4096)
    # model_dir: the HF checkpoint directory vLLM loads (config.json + *.safetensors, sharded index ok);
    # Llama, Qwen2 (qkv bias), Qwen3 (q/k norm). dtype: float32 | bfloat16 | float16.
    # Optional: attention="live" (alias "sliced": the live rows only, default on CPU) | "split" (split-KV
    # Triton kernel, live rows only with fixed shapes, default on CUDA) | "masked" (SDPA over the whole cache
    # with a mask: the fixed-shape reference); compile=True wraps the step in torch.compile;
    # cuda_graph=None|True|False; speculation=SpeculationConfig(k=4, ngram_min=2, ngram_max=4) (default) or
    # None (off). engine.runner (StepRunner) owns how a step runs; engine.set_drafter(factory) swaps prompt
    # lookup for another Drafter (DraftModelDrafter, an MTP head).

    engine.geometry            # KVGeometry(num_layers, num_kv_heads, head_dim, max_seq_len, dtype, device)
    engine.inject(k, v, num_tokens)
    # k, v: dense [num_layers, num_tokens, num_kv_heads, head_dim] (paged->dense is the transfer layer's job),
    # copied into cache positions [0, num_tokens).

    # Several users (seats=S): each request has a seat of the cache, all active ones decode in one forward a
    # step (decode/batch.py), each bit-identical to alone:
    #   engine = DecodeEngine.from_pretrained(model_dir, seats=4); engine.inject(k, v, n, seat=2)
    #   gen = engine.generate(first, n, params, seat=2)   # iterating it steps every active request
    #   engine.scheduler.step()                            # or drive the steps yourself (the node's engine thread)

    gen = engine.generate(first_token_id, num_prompt_tokens, SamplingParams(max_tokens=64, temperature=0.0))
    for token_id in gen:       # starts WITH first_token_id (sampled by the prefill), then position
        ...                    # num_prompt_tokens onwards
    gen.finish_reason          # "stop" | "length" | "abort" (cancelled); gen.token_ids; gen.seq_len
    gen.spec                   # SpecStats of this request (verify_steps, drafted/accepted tokens, histogram);
                               # engine.spec_stats: the same, cumulative
    gen.cancel()               # or engine.cancel(), or set the threading.Event passed as cancel_event=;
                               # checked between steps, from any thread

    logits = engine.prefill(token_ids)   # full forward from position 0 writing the cache (tests / fallback);
                                         # float32 logits [vocab] of the last position
    engine.capabilities()      # honoured sampling options, max_seq_len, model facts

SamplingParams: max_tokens (counts first_token_id), min_tokens, temperature (0 = greedy), top_p, top_k
(-1/0 = off), seed (reproducible), stop_token_ids, ignore_eos (eos ids come from config.json and
generation_config.json), repetition_penalty, presence_penalty, frequency_penalty (over the tokens this
request produced, like vLLM's output-token penalties; the decode node does not see prompt ids, so
repetition_penalty covers the prompt only when prompt_token_ids is given). Generation also stops when
prompt + output reaches max_seq_len ("length"). speculative=False opts one request out of speculation;
prompt_token_ids, when given, are also what prompt lookup drafts from (without them it looks up the
generated text only). Requests with penalties decode without speculation (exactness).

The loop reads one value from the device per step (the token id; with drafts, the verify decision: up to
k + 1 tokens); sampling, penalties and the next input stay on the device, step buffers are reused.
"""

from .cache import KVGeometry, StaticKVCache
from .engine import (CUDA_GRAPH_CHOICES, DecodeEngine, Generation, default_attention, parse_attention,
                     parse_dtype, resolve_cuda_graph)
from .runner import StepMode, StepRunner
from .sampling import HONOURED_SAMPLING_OPTIONS, SamplingParams
from .speculative import (AdaptiveDrafter, DraftModelDrafter, Drafter, PromptLookupDrafter, SpecStats,
                          SpeculationConfig, StepCosts)

__all__ = [
    "DecodeEngine",
    "Generation",
    "HONOURED_SAMPLING_OPTIONS",
    "KVGeometry",
    "SamplingParams",
    "StaticKVCache",
    "parse_dtype",
    "CUDA_GRAPH_CHOICES",
    "default_attention",
    "resolve_cuda_graph",
    "parse_attention",
    "StepMode",
    "StepRunner",
    "Drafter",
    "DraftModelDrafter",
    "PromptLookupDrafter",
    "AdaptiveDrafter",
    "SpecStats",
    "SpeculationConfig",
    "StepCosts",
]
