"""Mixtral: Mistral attention with a sparse MoE FFN (softmax router, top-k renormalized; experts w1/w3/w2)."""

from colibri.models.base import DecoderModel, ModelArgs, get
from colibri.models import mistral

Model = DecoderModel


def args(cfg: dict) -> ModelArgs:
    a = mistral.args(cfg)
    a.num_experts = int(get(cfg, "num_local_experts", default=8))
    a.top_k = int(get(cfg, "num_experts_per_tok", default=2))
    a.norm_topk_prob = True
    a.moe_intermediate_size = a.intermediate_size
    a.moe_layers = [True] * a.num_layers
    a.moe_prefix = "block_sparse_moe"
    a.expert_proj = ("w1", "w3", "w2")
    return a
