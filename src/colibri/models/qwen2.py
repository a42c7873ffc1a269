"""Qwen2 / Qwen2.5: llama math with biases on q/k/v; optional sliding window above `max_window_layers`."""

from colibri.models.base import FULL, SLIDING, DecoderModel, ModelArgs, base_args, get

Model = DecoderModel


def layer_types(cfg: dict) -> tuple[list[str], int | None]:
    """Sliding-window layers as the Qwen configs define them: explicit `layer_types`, or derived."""
    n = int(cfg["num_hidden_layers"])
    window = get(cfg, "sliding_window") if cfg.get("use_sliding_window") else None
    if cfg.get("layer_types"):
        types = [SLIDING if t == SLIDING else FULL for t in cfg["layer_types"]]
    else:
        start = int(get(cfg, "max_window_layers", default=n))
        types = [SLIDING if window is not None and i >= start else FULL for i in range(n)]
    if window is None:
        types = [FULL] * n
    return types, window


def args(cfg: dict) -> ModelArgs:
    types, window = layer_types(cfg)
    return base_args(cfg, attention_bias=True, layer_types=types, sliding_window=window)
