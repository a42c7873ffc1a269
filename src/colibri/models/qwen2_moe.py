"""Qwen2-MoE / Qwen1.5-MoE: Qwen2 attention; sparse layers every `decoder_sparse_step` (minus `mlp_only_layers`)
with routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

from colibri.models.base import ModelArgs, get
from colibri.models import qwen2
from colibri.models.base import DecoderModel

Model = DecoderModel


def sparse_layers(cfg: dict, n: int) -> list[bool]:
    step = int(get(cfg, "decoder_sparse_step", default=1))
    dense = set(get(cfg, "mlp_only_layers", default=[]))
    experts = int(get(cfg, "num_experts", "num_local_experts", default=0))
    return [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)]


def moe_fields(a: ModelArgs, cfg: dict, norm_topk_default: bool) -> ModelArgs:
    a.num_experts = int(get(cfg, "num_experts", "num_local_experts", default=0))
    a.top_k = int(get(cfg, "num_experts_per_tok", default=2))
    a.norm_topk_prob = bool(get(cfg, "norm_topk_prob", default=norm_topk_default))
    a.moe_intermediate_size = int(get(cfg, "moe_intermediate_size", default=a.intermediate_size))
    a.moe_layers = sparse_layers(cfg, a.num_layers)
    return a


def args(cfg: dict) -> ModelArgs:
    a = moe_fields(qwen2.args(cfg), cfg, norm_topk_default=False)
    a.shared_expert_intermediate_size = int(get(cfg, "shared_expert_intermediate_size", default=0))
    return a
