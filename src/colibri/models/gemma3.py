"""Gemma 3 text: interleaved local (sliding) / global layers with their own RoPE bases, (1 + w) RMSNorm in f32,
sandwich norms around attention and FFN, q/k norms, sqrt(D)-scaled embeddings, tanh-GELU, query_pre_attn_scalar."""

from colibri.models.base import FULL, SLIDING, DecoderModel, ModelArgs, base_args, get, rope_params

Model = DecoderModel


def args(cfg: dict) -> ModelArgs:
    if "text_config" in cfg:  # a multimodal Gemma3ForConditionalGeneration config: run its text model
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:
        pattern = int(get(cfg, "sliding_window_pattern", "_sliding_window_pattern", default=6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    types = [SLIDING if t == SLIDING else FULL for t in types]
    rp = dict(cfg.get("rope_parameters") or {})
    if FULL in rp or SLIDING in rp:
        rope = {FULL: dict(rp.get(FULL) or {}), SLIDING: dict(rp.get(SLIDING) or {})}
        rope[FULL].setdefault("rope_theta", float(get(cfg, "rope_theta", default=1_000_000.0)))
        rope[SLIDING].setdefault("rope_theta", float(get(cfg, "rope_local_base_freq", default=10_000.0)))
        for p in rope.values():
            p.setdefault("rope_type", "default")
    else:
        glob = rope_params({**cfg, "rope_theta": get(cfg, "rope_theta", default=1_000_000.0)})
        rope = {FULL: glob, SLIDING: {"rope_type": "default",
                                      "rope_theta": float(get(cfg, "rope_local_base_freq", default=10_000.0))}}
    hidden = int(cfg["hidden_size"])
    head_dim = int(get(cfg, "head_dim", default=256))
    return base_args(
        {**cfg, "model_type": "gemma3", "head_dim": head_dim},
        hidden_act=get(cfg, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
        tie_word_embeddings=bool(get(cfg, "tie_word_embeddings", default=True)),
        attention_bias=bool(get(cfg, "attention_bias", default=False)),
        qk_norm="head", gemma_norm=True, sandwich_norm=True,
        embed_scale=hidden ** 0.5,
        attn_scale=float(get(cfg, "query_pre_attn_scalar", default=head_dim)) ** -0.5,
        attn_softcap=get(cfg, "attn_logit_softcapping"),
        final_softcap=get(cfg, "final_logit_softcapping"),
        sliding_window=get(cfg, "sliding_window", default=4096),
        layer_types=types, rope=rope,
    )
