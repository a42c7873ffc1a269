"""Pictures of benchmark results for docs/performance.md, drawn from the JSON the benchmarks write.

    python benchmarks/plots.py --limited docs/data/limited-zen3.json --batch docs/data/batch-zen3.json --out docs/img

--limited: the JSON of `benchmarks/limited.py --json-out FILE` (several --config runs): decode tok/s per memory
configuration, beside the bound the disk allows at the bandwidth each run achieved (bytes read a token / GB/s).
--batch: the last JSON line of `benchmarks/batch.py`: aggregate tok/s against the number of sequences, and each
step's time split into the store's read wait and the rest (compute). Writes SVG files (text kept as text) named
after their inputs into --out. Needs matplotlib (`pip install -e .[plots]`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MIB = 1 << 20


def _config(r: dict) -> str:
    cg, ml = r.get("cgroup_limit_bytes"), r.get("memory_limit_bytes")
    if cg is None and ml is None:
        return "all in RAM"
    return f"cgroup {cg // MIB if cg else '-'} MiB\n--memory-limit {ml // MIB if ml else '-'} MiB"


def limited(path: Path, out: Path, plt) -> Path:
    """Decode tok/s per configuration, with the I/O bound where weights were read from disk."""
    report = json.loads(path.read_text())
    runs = [r for r in report["results"] if r.get("exit_code") == 0]
    names = [_config(r) for r in runs]
    speed = [r["decode_tokens_per_s"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(names, speed, color="#3b7dd8", label="decode tok/s")
    for i, r in enumerate(runs):
        per_token, gbs = r.get("weight_bytes_per_token"), r.get("read_gb_per_s")
        if per_token and gbs and r.get("memory_limit_bytes"):  # streamed: the disk's bound at its achieved rate
            bound = gbs * 1e9 / per_token
            ax.plot([i - 0.4, i + 0.4], [bound, bound], color="#d83b3b", linewidth=2,
                    label="disk bound (GB/s / bytes a token)" if i == len(runs) - 1 else None)
            ax.annotate(f"{per_token / 1e6:.0f} MB/token\n{gbs:.2f} GB/s", (i, bound), textcoords="offset points",
                        xytext=(0, 4), ha="center", fontsize=8)
        ax.annotate(f"{speed[i]:.2f}", (i, speed[i]), textcoords="offset points", xytext=(0, -12), ha="center",
                    fontsize=8, color="white")
    model = Path(report["model"]).name
    steps = "plain T = 1 steps" if all(r.get("draft_tokens") == 0 for r in runs) else "n-gram drafts on"
    ax.set_title(f"{model}: decode, {report['tokens']} tokens ({steps}), {report['threads']} threads", fontsize=10)
    ax.set_ylabel("tokens / s")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    dst = out / f"{path.stem}.svg"
    fig.savefig(dst, metadata={"Date": None})
    plt.close(fig)
    return dst


def batch(path: Path, out: Path, plt) -> Path:
    """Aggregate tok/s against B, and each step's read wait and compute."""
    report = json.loads(path.read_text())
    rows = report["rows"]
    bs = [r["batch"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.4))
    left.plot(bs, [r["aggregate_tokens_per_s"] for r in rows], marker="o", color="#3b7dd8")
    left.set_xlabel("sequences decoding together (B)")
    left.set_ylabel("aggregate tokens / s")
    left.set_xticks(bs)
    left.set_ylim(bottom=0)
    wait = [r["read_wait_s_per_step"] * 1e3 for r in rows]
    compute = [r["compute_s_per_step"] * 1e3 for r in rows]
    x = range(len(bs))
    right.bar(x, compute, color="#3b7dd8", label="compute")
    right.bar(x, wait, bottom=compute, color="#d8a03b", label="read wait")
    right.set_xticks(list(x), [str(b) for b in bs])
    right.set_xlabel("B")
    right.set_ylabel("ms per step")
    right.legend(fontsize=8)
    mb = rows[0]["bytes_read_per_step"] / 1e6
    fig.suptitle(f"one weight sweep per step: cgroup {report['cgroup_limit']}, --memory-limit "
                 f"{report['memory_limit']}, {mb:.0f} MB read a step", fontsize=10)
    fig.tight_layout()
    dst = out / f"{path.stem}.svg"
    fig.savefig(dst, metadata={"Date": None})
    plt.close(fig)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limited", type=Path, action="append", default=[], help="limited.py --json-out file")
    ap.add_argument("--batch", type=Path, action="append", default=[], help="batch.py's JSON line, in a file")
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    a = ap.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install -e .[plots]") from None
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small files, diffable
    matplotlib.rcParams["svg.hashsalt"] = "colibri"  # the same input draws the same file
    import matplotlib.pyplot as plt

    a.out.mkdir(parents=True, exist_ok=True)
    for p in a.limited:
        print(limited(p, a.out, plt))
    for p in a.batch:
        print(batch(p, a.out, plt))


if __name__ == "__main__":
    main()
