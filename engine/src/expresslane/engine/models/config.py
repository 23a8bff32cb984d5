"""Model geometry read from a Hugging Face checkpoint directory (the same directory vLLM loads).

Only decoder-only Llama-family checkpoints are accepted: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k
RMSNorm). Anything the engine would silently compute wrong (sliding window, unsupported RoPE scaling) is
rejected here with an error that says what was found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu",)
# safetensors dtype names the engine loads (converted to --dtype on load); quantized formats are not dequantized.
SUPPORTED_TENSOR_DTYPES = ("F32", "F16", "BF16")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option this engine does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type={model_type!r} (architectures={cfg.get('architectures')}) is not supported; "
                f"the express decode engine implements {SUPPORTED_MODEL_TYPES}"
            )
        architectures = cfg.get("architectures") or []
        unknown = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if unknown:
            raise UnsupportedModelError(f"architectures={architectures} is not supported; the express decode engine "
                                        f"implements {SUPPORTED_ARCHITECTURES}")
        if cfg.get("quantization_config"):
            method = (cfg["quantization_config"] or {}).get("quant_method", "?")
            raise UnsupportedModelError(f"quantized checkpoint (quantization_config.quant_method={method!r}) is not "
                                        f"supported: the decode engine loads float32, float16 or bfloat16 weights")
        act = cfg.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (supported: {SUPPORTED_ACTIVATIONS})")
        if cfg.get("use_sliding_window") and any(t == "sliding_attention" for t in cfg.get("layer_types") or ()):
            raise UnsupportedModelError("sliding-window attention layers are not supported by the decode engine")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        attention_bias = bool(cfg.get("attention_bias") or False)
        eos: list[int] = []
        for source in (cfg, generation_config or {}):
            value = source.get("eos_token_id")
            for tok in value if isinstance(value, list) else [value]:
                if tok is not None and int(tok) not in eos:
                    eos.append(int(tok))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never o_proj bias; Llama/Qwen3 use attention_bias for all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias") or False),
            qk_norm=model_type == "qwen3",
            rope=_rope_from_dict(cfg),
            eos_token_ids=tuple(eos),
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: --model must be a Hugging Face checkpoint directory")
        cfg = json.loads(config_path.read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls.from_dict(cfg, gen)


def safetensors_dtypes(model_dir: str | Path) -> dict[str, str]:
    """{safetensors dtype name: first tensor of that dtype} over a checkpoint's *.safetensors, from their headers
    alone (no tensor is read)."""
    found: dict[str, str] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 1 << 28:
                raise UnsupportedModelError(f"{path.name} is not a safetensors file (header size {size})")
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                found.setdefault(info["dtype"], f"{path.name}:{name}")
    return found


def check_checkpoint(model_dir: str | Path) -> ModelConfig:
    """Everything the decode engine can tell about a checkpoint directory before loading it: its config
    (architecture, activation, RoPE type, sliding window, quantization) and its tensors' dtypes. Returns the
    config; UnsupportedModelError names what it cannot serve, FileNotFoundError what is missing."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        raise UnsupportedModelError(f"no *.safetensors in {model_dir}" + (
            f" (found {bins[:3]}: PyTorch .bin checkpoints are not supported; convert them to safetensors)"
            if bins else ""))
    bad = {dtype: where for dtype, where in safetensors_dtypes(model_dir).items()
           if dtype not in SUPPORTED_TENSOR_DTYPES}
    if bad:
        raise UnsupportedModelError(f"tensor dtypes {sorted(bad)} (e.g. {next(iter(bad.values()))}) are not "
                                    f"supported: the decode engine loads {SUPPORTED_TENSOR_DTYPES}")
    return cfg


def _rope_from_dict(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type RoPE parameters are not supported")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    if params.get("partial_rotary_factor", 1.0) != 1.0 or cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    theta = params.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 8192)
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """main([MODEL_DIR]), which scripts/launch/decode-express.sh runs first: exit 0 and a one-line summary when the
    decode engine can serve the checkpoint, else exit 2 and one line naming what it cannot."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: check_checkpoint MODEL_DIR", file=sys.stderr)
        return 2
    try:
        cfg = check_checkpoint(args[0])
    except (UnsupportedModelError, FileNotFoundError, ValueError, KeyError) as e:
        kind = "unsupported checkpoint" if isinstance(e, UnsupportedModelError) else "not a checkpoint"
        print(f"expresslane: {kind}: {args[0]}: {e}", file=sys.stderr)
        return 2
    print(f"expresslane: {args[0]}: {cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads}/{cfg.num_kv_heads} heads, rope {cfg.rope.rope_type}: supported")
    return 0
