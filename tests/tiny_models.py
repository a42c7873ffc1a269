"""Tiny random Hugging Face checkpoints, one per supported model family.

Each builder makes a model with transformers itself (fixed seed), re-initializes
every parameter with a spread large enough that logits are well separated and
MoE routing is decisive, and writes it with `save_pretrained` (safetensors).
No tokenizer is written: the tests feed token ids.

Every config is chosen so that the family-specific feature is actually active
(see the comment on each builder), and every model has no reachable EOS token
(`eos_token_id=None`), so greedy runs always produce the full number of tokens.

    FAMILIES            names accepted by `build`
    build(name, outdir) -> Path   (outdir/<name>, built once; a finished build is reused)
    SEQ_LEN / PROMPT_LEN          lengths the configs are sized for

Two families (`llama`, `gemma3`) are written with a *legacy* config.json, the
layout real Hub checkpoints have (`rope_theta` + `rope_scaling`,
`rope_local_base_freq`) rather than the `rope_parameters` dict transformers 5
writes, so both layouts are covered; the builder checks transformers reads the
legacy file back to the same RoPE parameters.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

SEQ_LEN = 64  # logits tests
PROMPT_LEN = 16  # greedy tests (+32 generated)
INIT_STD = 0.2
NORM_STD = 0.2

_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _cfg(**over):
    d = dict(_COMMON)
    d.update(over)
    return d


def _llama():
    # GQA 4/2, untied lm_head, llama3 RoPE scaling. head_dim 16, theta 10000:
    # wavelengths 6.3, 20, 63, 200, ... with original_max_position_embeddings=32,
    # low/high freq factors 1/4 -> thresholds 32 and 8, so one frequency is kept,
    # one is smoothed and the rest are divided by `factor`.
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaForCausalLM, LlamaConfig(**_cfg(tie_word_embeddings=False, rope_parameters=rope))


def _llama_tied():
    # SmolLM2-like: tied embeddings, plain RoPE, GQA 4/2, 3 layers.
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(
        **_cfg(
            num_hidden_layers=3,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        )
    )


def _mistral():
    # sliding_window=16 < 64-token inputs (and < 16+32 greedy length).
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM, MistralConfig(
        **_cfg(sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    )


def _qwen2():
    # q/k/v biases (re-initialized non-zero), tied embeddings, GQA 4/2.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM, Qwen2Config(
        **_cfg(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    )


def _qwen3():
    # per-head q_norm/k_norm (RMSNorm), head_dim 32 != hidden/heads (16), untied.
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(
        **_cfg(
            head_dim=32,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    )


def _gemma3():
    # 3 layers: sliding(16) / full / sliding; local RoPE base 10000 vs global
    # 1e6; query_pre_attn_scalar 24 (!= head_dim 32); head_dim 32 != 64/4;
    # (1 + w) norms with w re-initialized non-zero, incl. q/k norms and the
    # pre/post feed-forward norms; gelu-tanh MLP; sqrt(hidden) embed scaling;
    # tied embeddings. No softcapping (gemma3 has none by default).
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM, Gemma3TextConfig(
        **_cfg(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window_pattern=2,  # legacy key, kept consistent with layer_types
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        )
    )


def _mixtral():
    # 4 experts, top-2 (softmax over all, renormalized top-k).
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM, MixtralConfig(
        **_cfg(
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    )


def _qwen2_moe():
    # 3 layers: 4 experts top-2, norm_topk_prob False, shared expert with
    # sigmoid shared_expert_gate; layer 1 is dense (mlp_only_layers=[1]);
    # q/k/v biases.
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM, Qwen2MoeConfig(
        **_cfg(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            qkv_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    )


def _qwen3_moe():
    # 4 experts top-2, norm_topk_prob True, q/k norms, head_dim 32 != 64/4.
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **_cfg(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    )
    cfg.head_dim = 32
    return Qwen3MoeForCausalLM, cfg


def _olmoe():
    # 4 experts top-2 (norm_topk_prob False), q_norm/k_norm over the full
    # projection width (not per head).
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return OlmoeForCausalLM, OlmoeConfig(
        **_cfg(
            num_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )


_BUILDERS = {
    "llama": _llama,
    "llama_tied": _llama_tied,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
}

FAMILIES = list(_BUILDERS)

# Families whose config.json is rewritten into the legacy Hub layout.
_LEGACY_CONFIG = {"llama", "gemma3"}

_SEEDS = {name: 1000 + i for i, name in enumerate(FAMILIES)}


def _is_norm(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and "norm" in parts[-2]


@torch.no_grad()
def _reinit(model, family: str, seed: int) -> None:
    """Re-draw every parameter: N(0, INIT_STD) for matrices/biases/embeddings,
    1 + N(0, NORM_STD) for RMSNorm weights (N(0, NORM_STD) for gemma's (1+w) norms)."""
    g = torch.Generator().manual_seed(seed)
    zero_centered_norm = family.startswith("gemma")
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if _is_norm(name):
            v = noise * NORM_STD + (0.0 if zero_centered_norm else 1.0)
        else:
            v = noise * INIT_STD
        p.copy_(v.to(p.dtype))
    if family == "gemma3":
        _gemma_spread(model)


@torch.no_grad()
def _gemma_spread(model) -> None:
    """Gemma multiplies embeddings by sqrt(hidden) and (with tied embeddings) reads
    logits off the same matrix, so a random model mostly predicts its input token
    and greedy decoding repeats one token forever. Shrink the embeddings and grow
    the sub-layer / final norm gains (still 1 + w with w random and non-zero) so the
    layers dominate the residual stream and logits keep a ~1.7 spread."""
    model.model.embed_tokens.weight.mul_(0.03 / INIT_STD)
    for name, p in model.named_parameters():
        if ".post_attention_layernorm." in name or ".post_feedforward_layernorm." in name:
            p.add_(2.0)
    model.model.norm.weight.add_(6.0)


def make_model(name: str):
    """The transformers model for `name`, re-initialized, in float32 eval mode (not saved)."""
    if name not in _BUILDERS:
        raise KeyError(f"unknown tiny family {name!r}; known: {FAMILIES}")
    seed = _SEEDS[name]
    torch.manual_seed(seed)
    model_cls, cfg = _BUILDERS[name]()
    model = model_cls(cfg).to(torch.float32).eval()
    _reinit(model, name, seed)
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    gc = model.generation_config
    gc.eos_token_id = None
    gc.bos_token_id = None
    gc.pad_token_id = None
    return model


def _legacy_rope(cfg: dict, family: str) -> dict:
    rp = cfg.pop("rope_parameters")
    if family == "gemma3":
        cfg["rope_theta"] = rp["full_attention"]["rope_theta"]
        cfg["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
        cfg["rope_scaling"] = None
        return cfg
    rp = dict(rp)
    cfg["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", "default") == "default":
        cfg["rope_scaling"] = None
    else:
        cfg["rope_scaling"] = rp
    return cfg


def _check_legacy_roundtrip(path: Path, expected_rope) -> None:
    from transformers import AutoConfig

    got = AutoConfig.from_pretrained(path).rope_parameters

    def norm(d):
        if isinstance(d, dict):
            return {k: norm(v) for k, v in d.items() if v is not None}
        return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else d

    if norm(got) != norm(expected_rope):
        raise AssertionError(f"legacy config for {path.name} reads back as {got}, expected {expected_rope}")


def with_chat(src: Path, outdir, words: int = 32) -> Path:
    """A copy of the tiny checkpoint `src` under `outdir/hf` with a word-level tokenizer.json (w0 .. w31, [UNK];
    `words`: w0 .. w{words-1}, and words = vocab_size - 1 makes every id a word, so the text is the tokens) and a
    one-line chat template beside it: a model that chat, the server and batch can drive."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    hf = Path(outdir) / "hf"
    shutil.copytree(src, hf)
    tok = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(words)}, "[UNK]": words}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                             "{% endfor %}assistant:")
    return hf


def build(name: str, outdir) -> Path:
    """Build the tiny `name` checkpoint under `outdir/name` (reused if already complete)."""
    outdir = Path(outdir)
    target = outdir / name
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    outdir.mkdir(parents=True, exist_ok=True)
    model = make_model(name)
    tmp = Path(tempfile.mkdtemp(dir=outdir, prefix=f".{name}."))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if name in _LEGACY_CONFIG:
            cfg_path = tmp / "config.json"
            cfg = json.loads(cfg_path.read_text())
            expected = model.config.rope_parameters
            cfg_path.write_text(json.dumps(_legacy_rope(cfg, name), indent=2, sort_keys=True) + "\n")
            _check_legacy_roundtrip(tmp, expected)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_reference(path, dtype=torch.float32):
    """Load a built checkpoint back with transformers (eager attention, eval, EOS disabled)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    gc = model.generation_config
    gc.eos_token_id = None
    gc.bos_token_id = None
    gc.pad_token_id = None
    return model


def token_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


if __name__ == "__main__":  # quick self-check: build all, report spread and greedy diversity
    import sys
    import time

    out = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="colibri-tiny-"))
    for fam in FAMILIES:
        t0 = time.time()
        p = build(fam, out)
        ref = load_reference(p)
        vocab = ref.config.vocab_size
        ids = torch.tensor([token_ids(SEQ_LEN, vocab, 1)])
        with torch.no_grad():
            lg = ref(ids).logits[0]
            gen = ref.generate(
                ids[:, :PROMPT_LEN], max_new_tokens=32, min_new_tokens=32, do_sample=False
            )[0, PROMPT_LEN:].tolist()
        top2 = lg.topk(2, dim=-1).values
        print(
            f"{fam:11s} {time.time() - t0:5.2f}s logit std {lg.std():.2f} "
            f"min top1-top2 gap {(top2[:, 0] - top2[:, 1]).min():.3f} "
            f"greedy unique {len(set(gen))}/32: {gen}"
        )
