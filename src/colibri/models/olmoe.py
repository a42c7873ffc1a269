"""OLMoE: llama attention with RMSNorm over the whole q and k projections (not per head), optional clip_qkv,
and routed experts without renormalization by default."""

from colibri.models.base import DecoderModel, ModelArgs, base_args, get
from colibri.models.qwen2_moe import moe_fields

Model = DecoderModel


def args(cfg: dict) -> ModelArgs:
    a = base_args(cfg, qk_norm="full", clip_qkv=get(cfg, "clip_qkv"),
                  attention_bias=bool(get(cfg, "attention_bias", default=False)))
    return moe_fields(a, cfg, norm_topk_default=False)
