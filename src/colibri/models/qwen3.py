"""Qwen3: Qwen2 attention without biases, with RMSNorm on each head of q and k before RoPE."""

from colibri.models.base import DecoderModel, ModelArgs, base_args, get
from colibri.models.qwen2 import layer_types

Model = DecoderModel


def args(cfg: dict) -> ModelArgs:
    types, window = layer_types(cfg)
    return base_args(cfg, attention_bias=bool(get(cfg, "attention_bias", default=False)), qk_norm="head",
                     layer_types=types, sliding_window=window)
