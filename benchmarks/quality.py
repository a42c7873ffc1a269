"""Perplexity of each storage kind on real text: the quality cost of quantization (writes docs/quality.md).

    python benchmarks/quality.py [--tokens 8192] [--models smollm2 qwen25] [--out docs/quality.md]

Each model's GGUF (from PyPI, see DESIGN.md) is dequantized once into a bf16 HF directory; that bf16 model is the
baseline, and is converted to q8, q4-g32, q4-g64 and q4-g128 containers. The original GGUF (imported losslessly)
is listed too (`convert --quant q4` of the .gguf: its Q4_0/Q4_1/Q8_0 tensors are kept bit-exact, other GGUF types
are re-quantized by the q4 policy). Text: the first --tokens tokens of CPython's pydoc topics (`pydoc_data.topics`, keys sorted).
Perplexity is computed with f32 activations (so only the stored weights differ between rows) and, for the
quantized rows, also with the default bf16 activations that the fast int4/int8 kernels use.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import real_models  # noqa: E402

import colibri  # noqa: E402
from colibri.convert.pipeline import ConvertOptions, convert  # noqa: E402
from colibri.runtime.evaluate import perplexity  # noqa: E402
from colibri.formats.gguf import GGUFCheckpoint  # noqa: E402

MODELS = {"smollm2": ("SmolLM2-135M-Instruct", real_models.smollm2_gguf),
          "qwen25": ("Qwen2.5-Coder-0.5B-Instruct", real_models.qwen25_gguf)}
KINDS = [("q8", "q8", 64), ("q4-g32", "q4", 32), ("q4-g64", "q4", 64), ("q4-g128", "q4", 128)]


def bf16_hf_dir(gguf: Path, out: Path) -> Path:
    """The GGUF's weights dequantized to bf16, saved as an HF directory (config, tokenizer, safetensors)."""
    ck = GGUFCheckpoint(gguf)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(ck.config, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "tokenizer.json").write_text(ck.tokenizer.to_str())
    save_file({n: ck.load(n).to(torch.bfloat16).contiguous() for n in ck.tensor_names()}, out / "model.safetensors")
    return out


def ppl(path, ids, dtype) -> float:
    m = colibri.load(path, dtype=dtype)
    value, _ = perplexity(m, ids)
    m.close()
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--out", default="docs/quality.md")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16-act", nargs="*", default=["smollm2"],
                    help="models that also get the bf16-activation column (it doubles the run time)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lines = ["# Quality of the storage kinds", "",
             f"Perplexity on the first {a.tokens} tokens of CPython's `pydoc_data.topics` text (keys sorted),",
             "produced by `python benchmarks/quality.py`. Baseline: the model's GGUF dequantized to bf16.",
             "f32 act. = activations in f32 (only the stored weights differ); bf16 act. = the default for",
             "quantized containers (torch's int4/int8 kernels). Bars from the container issue: q8 <= +1 %,",
             "q4-g64 <= +8 % over bf16.", ""]
    for key in a.models:
        title, locate = MODELS[key]
        gguf = locate()
        if gguf is None:
            print(f"skip {key}: package not installed", file=sys.stderr)
            continue
        with tempfile.TemporaryDirectory(dir=real_models.cache_dir()) as tmp:
            tmp = Path(tmp)
            hf = bf16_hf_dir(gguf, tmp / "bf16-hf")
            tok = colibri.load(gguf).tokenizer
            ids = tok.encode(real_models.pydoc_text()[: a.tokens * 8])[: a.tokens]
            rows = []
            t0 = time.perf_counter()
            base = ppl(hf, ids, "float32")
            rows.append(("bf16 (baseline)", base, None, hf))
            rows.append(("GGUF file via `convert --quant q4`", None, None, None))
            c = tmp / "gguf-import"
            convert(gguf, c, ConvertOptions(quant="q4", calibration="none"))
            both = key in a.bf16_act
            rows[-1] = ("GGUF file via `convert --quant q4`", ppl(c, ids, "float32"),
                        ppl(c, ids, "bfloat16") if both else None, c)
            for label, q, g in KINDS:
                c = tmp / label
                convert(hf, c, ConvertOptions(quant=q, group_size=g, calibration="none"))  # the fixed policy
                rows.append((label, ppl(c, ids, "float32"), ppl(c, ids, "bfloat16") if both else None, c))
            lines += [f"## {title}", "", "| weights | size MiB | bits/weight | ppl (f32 act.) | vs bf16 | ppl (bf16 act.) |",
                      "|---|---|---|---|---|---|"]
            for label, p32, p16, path in rows:
                m = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").exists() else None
                if m:
                    size = sum(f["size"] for f in m["files"])
                    params = sum(torch.Size(t["shape"]).numel() for t in m["tensors"])
                else:
                    size = (path / "model.safetensors").stat().st_size
                    params = size / 2
                delta = f"{100 * (p32 / base - 1):+.2f} %" if label != "bf16 (baseline)" else "-"
                lines.append(f"| {label} | {size / 2**20:.1f} | {8 * size / params:.2f} | {p32:.4f} | {delta} |"
                             f" {'-' if p16 is None else f'{p16:.4f}'} |")
            lines += ["", f"({time.perf_counter() - t0:.0f} s on this machine, {a.threads} threads)", ""]
            print("\n".join(lines[-len(rows) - 5:]), flush=True)
    Path(a.out).write_text("\n".join(lines))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
