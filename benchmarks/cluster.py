"""`colibri batch --ray`: aggregate throughput with 1 and 2 replicas, and the driver's own cost per line.

    python benchmarks/cluster.py [--model DIR] [--lines 32] [--tokens 32] [--threads 1] [--replicas 1,2]

One local Ray cluster (in a private network namespace: Ray binds to the machine's address, and benchmarks send
traffic to loopback only), then, for each replica count R, `colibri batch --ray --replicas R --threads T` on the
same --lines prompts (benchmarks/batch.py's PROMPTS, greedy, `ignore_eos`, --tokens tokens each), and once
`colibri batch` without Ray (one engine, T threads) as the baseline. Per run: the job's time from the first line
sent to the last written (the engines' load excluded), lines/s and tok/s, the mean line time (each record's
duration_s: added to its engine until finished) and the driver's own time per line (everything in its loop but
waiting for results: sending, receiving, writing and fsyncing the record), as a share of a line's time and of
the job's time. The projected scaling is R times one replica's tok/s: nodes
share nothing but the driver; on one machine the replicas share its cores, so the measured figure is below it.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from batch import PROMPTS  # noqa: E402


def job(args: list[str]) -> dict:
    """One `colibri batch` run in this process: its timings and the driver's overhead (Ray runs only)."""
    from colibri import batch, cli, cluster
    seen = {}
    run, local_run = cluster.ClusterBatch.run, batch.Batch.run

    def timed(original):
        def wrapper(self, lines, bar):
            t0 = time.perf_counter()
            try:
                return original(self, lines, bar)
            finally:
                seen["run_s"] = time.perf_counter() - t0
                seen["overhead_s"] = getattr(self, "overhead_s", None)
        return wrapper

    cluster.ClusterBatch.run, batch.Batch.run = timed(run), timed(local_run)
    try:
        assert cli.main(args) == 0
    finally:
        cluster.ClusterBatch.run, batch.Batch.run = run, local_run
    return seen


def measure(a, model: str, replicas: int | None, root: Path) -> dict:
    src, dst = root / "in.jsonl", root / f"out-{replicas}.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": PROMPTS[i % len(PROMPTS)] + f" # {i}",
                                       "ignore_eos": True}) + "\n" for i in range(a.lines)))
    args = ["batch", "--model", model, "--input", str(src), "--output", str(dst), "--max-tokens", str(a.tokens),
            "--temperature", "0", "--threads", str(a.threads)]
    if replicas is not None:
        args += ["--ray", "--replicas", str(replicas)]
    seen = job(args)
    recs = [json.loads(x) for x in dst.read_text().splitlines()]
    tokens = sum(r["completion_tokens"] for r in recs)
    line_s = sum(r["duration_s"] for r in recs) / len(recs)
    out = {"replicas": replicas, "lines": len(recs), "tokens": tokens, "run_s": round(seen["run_s"], 3),
           "lines_per_s": round(len(recs) / seen["run_s"], 3), "tok_per_s": round(tokens / seen["run_s"], 2),
           "mean_line_s": round(line_s, 4)}
    if seen["overhead_s"] is not None:
        per_line = seen["overhead_s"] / len(recs)
        out |= {"driver_ms_per_line": round(per_line * 1e3, 3),
                "driver_share_of_line": round(per_line / line_s, 5),
                "driver_share_of_run": round(seen["overhead_s"] / seen["run_s"], 5)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="container (default: the embedded SmolLM2's)")
    p.add_argument("--lines", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="compute threads per replica")
    p.add_argument("--replicas", default="1,2")
    a = p.parse_args()
    if os.environ.get("COLIBRI_BENCH_NETNS") != "1":  # re-run in a private network namespace
        if shutil.which("unshare") is None:
            sys.exit("needs unshare (util-linux) and root or user namespaces")
        env = {**os.environ, "COLIBRI_BENCH_NETNS": "1"}
        cmd = " ".join(map(repr, [sys.executable, *sys.argv]))
        sys.exit(subprocess.run(["unshare", "--net", "bash", "-c", f"ip link set lo up && exec {cmd}"],
                                env=env).returncode)
    import ray

    from colibri.convert.pipeline import default_container
    model = a.model or str(default_container())
    ray.init(num_cpus=os.cpu_count(), object_store_memory=80 * 1024**2, include_dashboard=False,
             log_to_driver=False)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        runs.append({"ray": False, **measure(a, model, None, Path(tmp))})
        for r in map(int, a.replicas.split(",")):
            runs.append({"ray": True, **measure(a, model, r, Path(tmp))})
    one = next((x for x in runs if x["replicas"] == 1), None)
    for x in runs:
        if one is not None and x["replicas"]:
            x["projected_tok_per_s"] = round(one["tok_per_s"] * x["replicas"], 2)
    print(json.dumps({"model": model, "threads_per_replica": a.threads, "cpus": os.cpu_count(), "runs": runs},
                     indent=1))


if __name__ == "__main__":
    main()
