"""A llama-architecture GGUF of any size with random valid blocks, kinds laid out as llama.cpp's Q4_K_M does
(Q4_K matrices, Q6_K for attn_v / ffn_down and the output table), plus other kinds in the first layer: Q5_0 for
attn_k (kept exactly), F16 for attn_output (converted by the q4 policy) and IQ2_XXS for attn_q (no exact kind yet:
converted with a notice).

Every layer's blocks are the same arrays (the writer holds references, not copies), so writing a file of gigabytes
takes memory for one layer. The weights are noise: for memory and speed only (tests/test_convert_bounded.py,
benchmarks/convert_bench.py --synthetic-gguf).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter

BLOCK_BYTES = {QT.Q4_K: 144, QT.Q6_K: 210, QT.Q5_0: 22, QT.IQ2_XXS: 66}
BLOCK_VALUES = {QT.Q4_K: 256, QT.Q6_K: 256, QT.Q5_0: 32, QT.IQ2_XXS: 256}
# layer shapes (d, ffn, heads, kv heads, vocab)
SHAPES = {"llama-2-7b": (4096, 11008, 32, 32, 32000), "test": (2048, 5632, 16, 16, 16384), "small": (1024, 2816, 8, 8, 8192)}


def blocks(qtype, n: int, k: int, seed: int, scale: float = 1e-3) -> np.ndarray:
    """Valid random blocks [n, k / block values * block bytes]: random codes and scales, sane positive f16 super-
    scales."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // BLOCK_VALUES[qtype], BLOCK_BYTES[qtype]), dtype=np.uint8)
    if qtype == QT.Q4_K:
        raw[..., 0:4] = (rng.uniform(0.2, 1.0, raw.shape[:2] + (2,)) * scale).astype(np.float16).view(np.uint8)
    elif qtype == QT.Q6_K:
        raw[..., 208:210] = (rng.uniform(0.2, 1.0, raw.shape[:2] + (1,)) * scale).astype(np.float16).view(np.uint8)
    else:  # Q5_0, IQ2_XXS: d first
        raw[..., 0:2] = (rng.uniform(0.2, 1.0, raw.shape[:2] + (1,)) * scale).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def llama_writer(path: Path, layers: int, d: int, f: int, heads: int, kv: int, context: int = 256) -> GGUFWriter:
    """A GGUFWriter for a llama-architecture model with these dimensions, its metadata added."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    return w


def write(path: Path, shape: str = "small", layers: int = 2) -> Path:
    """Write the GGUF; returns its path."""
    d, f, heads, kv, vocab = SHAPES[shape]
    w = llama_writer(path, layers, d, f, heads, kv, context=4096)
    w.add_tensor("token_embd.weight", blocks(QT.Q4_K, vocab, d, seed=1), raw_dtype=QT.Q4_K)
    w.add_tensor("output.weight", blocks(QT.Q6_K, vocab, d, seed=2), raw_dtype=QT.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    kvd = d // heads * kv
    rng = np.random.default_rng(3)
    mats = {"attn_q": (d, d, QT.Q4_K), "attn_k": (kvd, d, QT.Q4_K), "attn_v": (kvd, d, QT.Q6_K),
            "attn_output": (d, d, QT.F16), "ffn_gate": (f, d, QT.Q4_K), "ffn_up": (f, d, QT.Q4_K),
            "ffn_down": (d, f, QT.Q6_K)}
    data = {name: (rng.standard_normal((n, k), dtype=np.float32) * 1e-2).astype(np.float16) if qtype == QT.F16
            else blocks(qtype, n, k, seed=10 + i) for i, (name, (n, k, qtype)) in enumerate(mats.items())}
    iq2 = blocks(QT.IQ2_XXS, d, d, seed=30)
    q5_0 = blocks(QT.Q5_0, kvd, d, seed=31)
    norm = np.ones(d, np.float32)
    for layer in range(layers):
        for name, (n, k, qtype) in mats.items():
            if layer == 0 and name == "attn_q":
                w.add_tensor(f"blk.{layer}.{name}.weight", iq2, raw_dtype=QT.IQ2_XXS)
            elif layer == 0 and name == "attn_k":
                w.add_tensor(f"blk.{layer}.{name}.weight", q5_0, raw_dtype=QT.Q5_0)
            elif layer == 0 and qtype == QT.F16:
                w.add_tensor(f"blk.{layer}.{name}.weight", data[name])
            elif qtype == QT.F16:
                w.add_tensor(f"blk.{layer}.{name}.weight", data["attn_q"], raw_dtype=QT.Q4_K)
            else:
                w.add_tensor(f"blk.{layer}.{name}.weight", data[name], raw_dtype=qtype)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{name}.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
