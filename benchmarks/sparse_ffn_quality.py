"""Quality and FFN bytes of the LOSSY sparse FFN (`colibri calibrate` + `--sparse-ffn`) against the dense model.

    python benchmarks/sparse_ffn_quality.py [--model CONTAINER] [--targets 0.1,0.3] [--uniform 0.1,0.3]
                                            [--tokens 1024] [--greedy 256] [--calibration-tokens 512]
                                            [--chunk-drop 32:0.05,32:0.1]

Calibration text: the source of CPython's pydoc module (Lib/pydoc.py), recorded once (sparse_calibrate.Calibration)
and every setting chosen from that record; held-out text: other standard-library
source (argparse, dataclasses), which calibration never reads. Per setting (each target mean sparsity, by the
greedy allocation and by the uniform one, and the default: uniform, --max-ppl-increase 2): perplexity on both
texts in one causal pass over their first --tokens tokens,
top-1 agreement with the dense model on both texts (teacher-forced: the fraction of positions whose argmax
is the dense one's), greedy agreement over --greedy tokens of a code prompt (the fraction before the first
difference), the FFN sparsity achieved on the held-out text and the FFN bytes a chunked reader would need per
token there, against dense. Prints one JSON line per setting. Last, per setting: how the chunks a pass needs grow
with the rows in it (the union of B consecutive held-out tokens' active chunks, B = 1 .. 64; tokens of
one text stand in for batch mates, which share less, so it is a lower bound on a real batch's union).

--chunk-drop C:F,...: the structured alternative a chunked reader could use whatever the neurons' own sparsity:
per token and dense layer, drop the fraction F of the C-neuron chunks (stored order) whose sum of |act(gate)| is
smallest (their up rows and down columns would not be read); the same rows as a setting above, no calibration.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import torch

import colibri
from colibri.convert.pipeline import default_container
from colibri.runtime import sparse_calibrate, sparsity

HELD_OUT_MODULES = ("argparse", "dataclasses")
PROMPT = "def parse_arguments(argv):\n    \"\"\"Parse the command line and return the options.\"\"\"\n"


def source(*modules: str) -> str:
    return "\n\n".join(Path(importlib.util.find_spec(m).origin).read_text(encoding="utf-8") for m in modules)


def agreement(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(1, len(a))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--targets", default="0.1,0.2,0.3,0.5", help="greedy allocation")
    ap.add_argument("--uniform", default="0.1,0.3,0.5")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--calibration-tokens", type=int, default=sparse_calibrate.DEFAULT_TOKENS)
    ap.add_argument("--greedy", type=int, default=256)
    ap.add_argument("--chunk-drop", default="", help="C:F,... structured chunk dropping (see above)")
    a = ap.parse_args()
    path = Path(a.model) if a.model else default_container()
    texts = {"pydoc": source("pydoc"), "held_out": source(*HELD_OUT_MODULES)}
    with colibri.load(path, batch_size=max(a.tokens, a.calibration_tokens)) as m:
        ids = {k: m.prompt_ids(t)[:a.tokens] for k, t in texts.items()}

        def run(name: str) -> tuple[dict, list[int]]:
            t0 = time.perf_counter()
            row = {"setting": name}
            for k, v in ids.items():
                logits = torch.cat(list(m.engine.score(v[:-1], len(v))))  # [n - 1, V], one pass
                nll = torch.nn.functional.cross_entropy(logits, torch.tensor(v[1:])).item()
                row[f"ppl_{k}"] = round(math.exp(nll), 4)
                top[(name, k)] = logits.argmax(-1)
            got = m.generate(PROMPT, max_tokens=a.greedy, temperature=0.0, ignore_eos=True).token_ids
            row["seconds"] = round(time.perf_counter() - t0, 1)
            return row, got

        def against_dense(row: dict, name: str) -> dict:
            """row plus its perplexity increases and top-1 agreement against the dense run, per text."""
            for k in ("pydoc", "held_out"):
                row[f"ppl_{k}_increase_pct"] = round(100 * (row[f"ppl_{k}"] / dense[f"ppl_{k}"] - 1), 2)
                row[f"top1_agreement_{k}"] = round(float((top[(name, k)] == top[("dense", k)]).float().mean()), 4)
            return row

        top: dict = {}
        rows: dict[str, _Rows] = {}
        dense, ref = run("dense")
        print(json.dumps(dense), flush=True)
        t0 = time.perf_counter()
        cal = sparse_calibrate.Calibration(m, m.prompt_ids(texts["pydoc"])[:a.calibration_tokens], "pydoc.py")
        print(json.dumps({"recorded_s": round(time.perf_counter() - t0, 1), "chunk": cal.chunk}), flush=True)
        settings = [(f"greedy={t}", float(t), None) for t in a.targets.split(",") if t]
        settings += [(f"uniform={t}", float(t), None) for t in a.uniform.split(",") if t]
        settings += [("max_ppl_increase=2", None, 2.0)]
        for name, target, budget in settings:
            side = cal.choose(target, budget, allocation="greedy" if name.startswith("greedy") else "uniform")
            hook = sparsity.SparseFFN(side, sparsity.ffn_bytes(m.checkpoint, m.args))
            m.decoder.ffn_hook = rows[name] = _Rows(hook)
            try:
                row, got = run(name)
            finally:
                m.decoder.ffn_hook = None
            st = hook.counters()
            row.update(target_sparsity=side.info["target_sparsity"], greedy_agreement=round(agreement(ref, got), 4),
                       ffn_sparsity=st["ffn_sparsity"], ffn_bytes_needed_per_token=st["ffn_bytes_needed_per_token"],
                       ffn_dense_bytes_per_token=st["ffn_dense_bytes_per_token"],
                       calib_chunk_sparsity_coactivation=side.info["chunk_sparsity_coactivation_order"],
                       calib_chunk_sparsity_stored=side.info["chunk_sparsity_stored_order"],
                       calib_ppl_dense=side.info["perplexity_dense"], calib_ppl_sparse=side.info["perplexity_sparse"])
            print(json.dumps(against_dense(row, name)), flush=True)
        for spec in (x for x in a.chunk_drop.split(",") if x):
            c, f = spec.split(":")
            name = f"chunk_drop={spec}"
            m.decoder.ffn_hook = _ChunkDrop(int(c), float(f))
            try:
                row, got = run(name)
            finally:
                m.decoder.ffn_hook = None
            row.update(chunk=int(c), chunks_dropped=float(f), greedy_agreement=round(agreement(ref, got), 4))
            print(json.dumps(against_dense(row, name)), flush=True)
    # the chunks a pass needs as its rows grow, over the held-out scoring pass
    for name, r in rows.items():
        held = r.chunks[m.args.num_layers:2 * m.args.num_layers]  # [pydoc pass, held-out pass, decode steps...]
        union = {}
        for b in (1, 2, 4, 8, 16, 32, 64):
            need = [float(c[: c.shape[0] // b * b].view(-1, b, c.shape[1]).any(1).float().mean()) for c in held]
            union[b] = round(1 - sum(need) / len(need), 4)
        print(json.dumps({"setting": name, "chunks_skipped_by_pass_rows": union}), flush=True)


class _ChunkDrop:
    """Per row and dense layer: zero the hidden product of the round(f * I / c) chunks of c neurons (stored order)
    with the smallest sum of |act(gate)| (ties to the lower chunk: topk's order)."""

    def __init__(self, c: int, f: float):
        self.c, self.f = c, f

    def hidden(self, layer, a, u, down):
        t, n = a.shape
        if n % self.c:
            raise SystemExit(f"--chunk-drop: {n} neurons are not whole chunks of {self.c}")
        score = a.abs().float().view(t, n // self.c, self.c).sum(-1)  # [T, C]
        drop = round(self.f * (n // self.c))
        keep = torch.ones_like(score, dtype=torch.bool)
        if drop:
            keep.scatter_(1, score.topk(drop, dim=1, largest=False).indices, False)
        return a * u * keep.repeat_interleave(self.c, 1).to(a.dtype)


class _Rows:
    """The sparse hook, also keeping each layer's chunk activity per row [T, C]."""

    def __init__(self, inner: sparsity.SparseFFN):
        self.inner, self.chunks = inner, []

    def hidden(self, layer, a, u, down):
        keep = a.abs() > self.inner.side.thresholds[layer]
        self.chunks.append(sparsity.chunk_activity(keep, self.inner.side.order[layer], self.inner.side.chunk))
        return self.inner.hidden(layer, a, u, down)


if __name__ == "__main__":
    main()
