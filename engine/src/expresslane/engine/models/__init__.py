"""Model definitions for the express decode engine: config parsing, RoPE, fused Llama-family transformer,
strict safetensors loading."""

from .config import ModelConfig, RopeConfig, UnsupportedModelError
from .loader import load_model
from .transformer import Transformer

__all__ = ["ModelConfig", "RopeConfig", "Transformer", "UnsupportedModelError", "load_model"]
