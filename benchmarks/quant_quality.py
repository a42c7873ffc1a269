"""Bytes and perplexity of colibri's q4 containers against their source, with llama.cpp's Q4_K_M as a peer.

    python benchmarks/quant_quality.py --gguf MODEL.gguf [--windows 4] [--full 1024] [--llama-quantize BIN]

Rows, all scored by colibri itself with f32 activations (only the stored weights differ):
  source        the GGUF dequantized (colibri.load of the .gguf)
  new           `colibri convert` (the default: Q4_K / Q6_K kept exactly as q4k / q8k, the tied table once,
                other block types by the fixed policy)
  old           `colibri convert --requantize` (the fixed policy for every tensor: v_proj/down_proj and the
                tables at q8, the rest q4-g64, plain fit; the default before exact K-quant import)
  calibrated    `colibri convert --requantize --calibration builtin` (calibrated mix within the Q4_K_M budget)
  llama.cpp     llama-quantize Q4_K_M (no imatrix) of an f16 GGUF of the dequantized source, loaded by colibri
  q4_k_m        `colibri convert --quant q4_k_m` of that f16 GGUF (llama.cpp's recipe and block search, quant/kquant.py)
  q4_k_m-imat   the same with --imatrix builtin
  q4-f16        `colibri convert --quant q4` of that f16 GGUF (Colibri's fixed policy from float weights)
  q6_k, q8_0    `colibri convert --quant q6_k` / `--quant q8_0` of that f16 GGUF
  q4_k_m-ggml   (--ggml-lib) the q4_k_m container with every block made by llama.cpp's own ggml_quantize_chunk
                (q4_k_m-imat-ggml: with the same builtin importance): llama.cpp's Q4_K_M of the source, same layout
  q5_k_m, q5_k_m-ggml   the same for Q5_K_M
  llama.cpp-q5_k_m      llama-quantize Q5_K_M of the f16 GGUF, loaded by colibri (its Q5_K kept exactly as q5k)
Texts: the start of CPython's pydoc topics (keys sorted; calibration reads only its end) and held-out standard
library source (modules the built-in calibration does not read). Two ways: llama.cpp's (independent windows of
512 tokens, the second half of each scored) and one causal pass over the first --full tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

import colibri
from colibri.convert import calibrate
from colibri.convert.pipeline import ConvertOptions, convert
from colibri.quant import kquant
from colibri.runtime.evaluate import perplexity

HELD_OUT_MODULES = ("argparse", "dataclasses", "enum", "pathlib")  # none is in calibrate.CODE_MODULES
WINDOW = 512


def texts() -> dict[str, str]:
    from pydoc_data import topics

    assert not set(HELD_OUT_MODULES) & set(calibrate.CODE_MODULES)
    pydoc = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    pydoc = pydoc[: len(pydoc) - calibrate.PROSE_TAIL_CHARS]  # never the calibration's part
    code = "\n\n".join(Path(importlib.util.find_spec(m).origin).read_text(encoding="utf-8") for m in HELD_OUT_MODULES)
    return {"pydoc": pydoc, "stdlib": code}


@torch.inference_mode()
def windowed(model, ids: list[int], windows: int) -> tuple[float, int]:
    """llama.cpp's perplexity: independent WINDOW-token windows, each scoring its second half."""
    total, count = 0.0, 0
    for w in range(windows):
        chunk = ids[w * WINDOW:(w + 1) * WINDOW]
        if len(chunk) < WINDOW:
            break
        logits = torch.cat(list(model.engine.score(chunk, WINDOW)))  # [WINDOW, V], a fresh cache per window
        half = WINDOW // 2
        target = torch.tensor(chunk[half + 1:])
        total += torch.nn.functional.cross_entropy(logits[half:-1], target, reduction="sum").item()
        count += len(target)
    return math.exp(total / count), count


def f16_gguf(src: Path, dst: Path) -> None:
    """The GGUF's tensors dequantized to f16 (vectors f32) with its metadata: llama-quantize's input."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, field.contents(), vtype)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        data = data.astype(np.float32 if data.ndim == 1 or len(t.shape) == 1 else np.float16)
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ggml_blocks(lib_path: Path):
    """kquant.quantize_blocks done by llama.cpp's own ggml_quantize_chunk (ctypes on its libggml-base)."""
    import ctypes

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    lib = ctypes.CDLL(str(lib_path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def quantize(w: torch.Tensor, gguf_type: str, importance: torch.Tensor | None = None) -> np.ndarray:
        t = GGMLQuantizationType[gguf_type]
        block, nbytes = GGML_QUANT_SIZES[t]
        x = np.ascontiguousarray(w.float().numpy())
        n, k = x.shape
        out = np.zeros((n, k // block * nbytes), np.uint8)
        imp = None if importance is None else np.ascontiguousarray(importance.float().numpy())
        lib.ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, n, k,
                                None if imp is None else imp.ctypes.data)
        return out

    return quantize


def size_of(path: Path) -> int:
    if path.is_dir():
        return sum(f["size"] for f in json.loads((path / "manifest.json").read_text())["files"])
    import gguf
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/colibri-quant-quality"))
    ap.add_argument("--windows", type=int, default=4, help="512-token windows per text (default 4)")
    ap.add_argument("--full", type=int, default=1024, help="tokens of the full-sequence pass (default 1024)")
    ap.add_argument("--llama-quantize", type=Path, help="llama.cpp's llama-quantize binary (peer row)")
    ap.add_argument("--rows", nargs="*", default=["source", "new", "old", "llama.cpp"],
                    help="of source, new, old, calibrated, llama.cpp, llama.cpp-q5_k_m, q4_k_m, q4_k_m-imat, q5_k_m,"
                         " q4-f16, q6_k, q8_0 (and the -ggml rows)")
    ap.add_argument("--container", action="append", default=[], metavar="LABEL=PATH",
                    help="also score an existing container (an ablation), as row LABEL")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ggml-lib", type=Path, help="llama.cpp's libggml-base.so: rows q4_k_m-ggml, q4_k_m-imat-ggml")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    paths = {"source": a.gguf, "old": a.work / "old-q4", "new": a.work / "new-default",
             "calibrated": a.work / "calibrated", "llama.cpp": a.work / "llamacpp-q4_k_m.gguf",
             "q4_k_m": a.work / "kq-q4_k_m", "q4_k_m-imat": a.work / "kq-q4_k_m-imat", "q4-f16": a.work / "f16-q4",
             "q6_k": a.work / "kq-q6_k", "q8_0": a.work / "kq-q8_0",
             "q4_k_m-ggml": a.work / "ggml-q4_k_m", "q4_k_m-imat-ggml": a.work / "ggml-q4_k_m-imat",
             "q5_k_m": a.work / "kq-q5_k_m", "q5_k_m-ggml": a.work / "ggml-q5_k_m",
             "llama.cpp-q5_k_m": a.work / "llamacpp-q5_k_m.gguf"}
    builds = {"new": ConvertOptions(quant="q4"), "old": ConvertOptions(quant="q4", requantize=True),
              "calibrated": ConvertOptions(quant="q4", requantize=True, calibration="builtin")}
    from_f16 = {"q4_k_m": ConvertOptions(quant="q4_k_m"), "q4_k_m-imat": ConvertOptions(quant="q4_k_m", imatrix="builtin"),
                "q4-f16": ConvertOptions(quant="q4"), "q6_k": ConvertOptions(quant="q6_k"),
                "q8_0": ConvertOptions(quant="q8_0"), "q4_k_m-ggml": ConvertOptions(quant="q4_k_m"),
                "q4_k_m-imat-ggml": ConvertOptions(quant="q4_k_m", imatrix="builtin"),
                "q5_k_m": ConvertOptions(quant="q5_k_m"), "q5_k_m-ggml": ConvertOptions(quant="q5_k_m")}
    seconds = {}
    for extra in a.container:
        label, path = extra.split("=", 1)
        paths[label] = Path(path)
        a.rows.append(label)
    for row in a.rows:
        t0 = time.perf_counter()
        if row in builds and not paths[row].exists():
            convert(a.gguf, paths[row], builds[row])
        elif row in ("llama.cpp", "llama.cpp-q5_k_m", *from_f16) and not paths[row].exists():
            f16 = a.work / "source-f16.gguf"
            if not f16.exists():
                f16_gguf(a.gguf, f16)
            if row in from_f16:
                own = kquant.quantize_blocks
                if row.endswith("-ggml"):
                    kquant.quantize_blocks = ggml_blocks(a.ggml_lib)
                try:
                    convert(f16, paths[row], from_f16[row])
                finally:
                    kquant.quantize_blocks = own
                seconds[row] = time.perf_counter() - t0
                continue
            ftype = "Q5_K_M" if row == "llama.cpp-q5_k_m" else "Q4_K_M"
            subprocess.run([str(a.llama_quantize), str(f16), str(paths[row]), ftype], check=True,
                           stdout=subprocess.DEVNULL)
        seconds[row] = time.perf_counter() - t0
    tok = colibri.load(a.gguf).tokenizer
    ids = {k: tok.encode(v[: 8 * max(a.full, a.windows * WINDOW)]) for k, v in texts().items()}
    results = {}
    for row in a.rows:
        m = colibri.load(paths[row], dtype="float32")
        r = {"bytes": size_of(paths[row]), "build_s": round(seconds[row], 1)}
        for k, v in ids.items():
            r[f"{k}_win"], r[f"{k}_win_tokens"] = windowed(m, v, a.windows)
            r[f"{k}_full"], _ = perplexity(m, v[: a.full])
        m.close()
        results[row] = r
        print(row, json.dumps(r), flush=True)
    base = results.get("source")
    print("\n| weights | MB | vs source | pydoc win | stdlib win | pydoc full | stdlib full |")
    print("|---|---|---|---|---|---|---|")
    for row, r in results.items():
        def cell(key):
            d = f" ({100 * (r[key] / base[key] - 1):+.2f} %)" if base and row != "source" else ""
            return f"{r[key]:.4f}{d}"
        ratio = f"{r['bytes'] / base['bytes']:.3f}x" if base else "-"
        print(f"| {row} | {r['bytes'] / 1e6:.1f} | {ratio} | {cell('pydoc_win')} | {cell('stdlib_win')} |"
              f" {cell('pydoc_full')} | {cell('stdlib_full')} |")
    if base:
        print(f"\nscored tokens: windows {base['pydoc_win_tokens']} + {base['stdlib_win_tokens']}, "
              f"full {a.full} + {a.full} per row")
    (a.work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
