"""Qwen3-MoE: Qwen3 attention (per-head q/k norms) with routed experts, no shared expert."""

from colibri.models.base import DecoderModel, ModelArgs
from colibri.models import qwen3
from colibri.models.qwen2_moe import moe_fields

Model = DecoderModel


def args(cfg: dict) -> ModelArgs:
    return moe_fields(qwen3.args(cfg), cfg, norm_topk_default=True)
