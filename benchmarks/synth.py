"""Write a container with a real architecture's shape and random weights, directly in q4/q8.

    python benchmarks/synth.py --shape llama-2-7b --output /nvme/synth-7b [--quant q4] [--group-size 64]
                               [--layers N]

No bf16 checkpoint is materialized: each tensor's quantized buffers are drawn at random and written through the
same writer as `colibri convert` (layout, journal, checksums, verification, atomic rename). The result loads
with `colibri.load` and runs, which is what the streaming runtime's I/O benchmarks need at sizes no real model
here has. The weights are noise: use these containers for speed only, never for quality figures.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch

from colibri.formats import container
from colibri.quant import kinds as quant
from colibri.convert.pipeline import ConvertOptions, write_container
from colibri.models import family

SHAPES = {
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "llama-2-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, rope_theta=1e6),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6),
}


def random_weight(entry: container.TensorEntry, gen: torch.Generator):
    """Random stored buffers for one tensor: quantized bytes drawn directly, floats small and well-scaled."""
    shape = tuple(entry.shape)
    if entry.kind in container.FLOAT_KINDS:
        if len(shape) == 1:
            return torch.ones(shape)
        return torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    buffers = {}
    for name, part in entry.parts.items():
        dt = container.DTYPES[part.dtype]
        if name == "qweight":
            lo, hi = (0, 256) if dt == torch.uint8 else (-127, 128)
            buffers[name] = torch.randint(lo, hi, part.shape, generator=gen, dtype=dt)
        elif name == "scales_zeros":
            sz = torch.zeros(part.shape, dtype=dt)
            sz[..., 0] = 0.02
            buffers[name] = sz
        else:
            buffers[name] = torch.full(part.shape, 0.002, dtype=dt)
    return quant.from_buffers(entry.kind, shape, entry.group_size, buffers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--quant", choices=["q4", "q8"], default="q4")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64, help="MB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--layers", type=int, help="keep the shape but only this many layers (a smaller container)")
    a = ap.parse_args()
    out = Path(a.output)
    if out.exists() and not a.force:
        sys.exit(f"error: {out} exists; pass --force")
    cfg = dict(SHAPES[a.shape])
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    model_args = family(cfg["model_type"]).args(cfg)
    shapes = family(cfg["model_type"]).Model(model_args).weight_shapes()
    opts = ConvertOptions(quant=a.quant, group_size=a.group_size, page_size_mb=a.page_size)
    gen = torch.Generator().manual_seed(a.seed)
    fp = hashlib.sha256(f"synthetic/{a.shape}/{a.layers}/{opts}/{a.seed}".encode()).hexdigest()[:16]
    t0 = time.perf_counter()
    report = write_container(out, cfg, shapes, model_args.tie_word_embeddings, opts,
                             lambda e: random_weight(e, gen), fp, {"kind": "synthetic", "path": a.shape},
                             lambda work: {"file": None, "chat_template_file": None, "special": {}})
    params = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"{a.shape}: {params / 1e9:.2f} B parameters -> {report.total_bytes / 2**30:.2f} GiB {a.quant} in "
          f"{time.perf_counter() - t0:.1f} s ({report.total_bytes / 2**20 / report.seconds:.0f} MiB/s) at {out}")


if __name__ == "__main__":
    main()
