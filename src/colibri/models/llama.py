"""Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2 and other llama-architecture checkpoints."""

from colibri.models.base import DecoderModel, ModelArgs, base_args, get

Model = DecoderModel


def args(cfg: dict) -> ModelArgs:
    bias = bool(get(cfg, "attention_bias", default=False))  # on q/k/v and o alike
    return base_args(cfg, attention_bias=bias, o_bias=bias)

