"""Mistral: llama math with sliding-window attention on every layer when `sliding_window` is set."""

from colibri.models.base import FULL, SLIDING, DecoderModel, ModelArgs, base_args, get

Model = DecoderModel


def args(cfg: dict) -> ModelArgs:
    window = get(cfg, "sliding_window")
    n = int(cfg["num_hidden_layers"])
    return base_args(cfg, sliding_window=window, layer_types=[SLIDING if window else FULL] * n)
