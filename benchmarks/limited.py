"""Decode speed of a container with the whole process confined by a cgroup-v1 memory limit.

    python benchmarks/limited.py --model DIR [--cgroup-limit 800M] [--memory-limit 500M] [--tokens 64]
    python benchmarks/limited.py --model DIR --config none,none --config 800M,500M --config 600M,300M
    python benchmarks/limited.py --model DIR --config 800M,500M --sparse-ffn default   (LOSSY: the sidecar's FFN counters too)

Each configuration runs in a fresh child process inside a fresh child memory cgroup of our own cgroup
(`/proc/self/cgroup`, controller mounted at /sys/fs/cgroup/memory). `--cgroup-limit` is written to
`memory.limit_in_bytes`, which charges page cache as well as anonymous memory: it caps the whole process the way a
small machine would. Without it the cgroup is only used for accounting. `--memory-limit` is the engine's own
budget (colibri.load's memory_limit); omit it (or write `none`) to keep every weight in RAM. A configuration is
`CGROUP_LIMIT,MEMORY_LIMIT`, either side `none`. The page cache is dropped before every run (cold start: weights
come from disk), and the cgroup is removed afterwards, also on error.

The child loads with `colibri.load(path, memory_limit, io_threads, threads[, prefetch_depth, ctx_length])` and
generates greedily (temperature 0, EOS ignored so every run produces exactly --tokens tokens). Per configuration
the parent prints one summary line (decode tok/s, TTFT, bytes read from disk, peak RSS, the cgroup's max usage and
failcnt, OOM kills), then one JSON object with everything, and says whether the generated tokens agree across the
configurations that completed. A child killed by the OOM killer (exit -9) or failing otherwise is reported, not
raised. Needs root and the cgroup-v1 memory controller; exits with status 2 otherwise.

On a shared 2-core machine other processes distort the figures: every run records the processes that used over
20 % of a core meanwhile (and warns); `--wait-idle S` waits for a quiet machine before each run and
`--retry-busy N` reruns a disturbed configuration up to N times.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MEMCG_ROOT = Path("/sys/fs/cgroup/memory")
BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")
PROMPT = "def quicksort(arr):"
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | None) -> int | None:
    """Bytes from '800M', '1.5G', '123' (binary units); None for None/'none'/''."""
    if text is None or str(text).strip().lower() in ("", "none", "unlimited"):
        return None
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in _UNITS else (t, "")
    return int(float(num) * _UNITS[unit])


def fmt_size(n: int | None) -> str:
    return "none" if n is None else f"{n / 2**20:.0f}M"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- child: one measurement, one JSON line on stdout

def child(a: argparse.Namespace) -> None:
    from colibri.cli import quiet_openmp  # torch-free: OpenMP's wait policy as `colibri run` would choose it

    quiet_openmp(argparse.Namespace(command="run", model=a.model, memory_limit=a.memory_limit))
    t0 = time.perf_counter()
    import torch  # noqa: F401  (imported first so the baseline is python + torch + colibri)

    import colibri

    rss_import = rss_bytes()
    t1 = time.perf_counter()
    opts = {"prefetch_depth": a.prefetch_depth, "ctx_length": a.ctx_length,  # passed only when given
            "draft_tokens": a.draft_tokens, "sparse_ffn": a.sparse_ffn}
    m = colibri.load(a.model, memory_limit=parse_size(a.memory_limit), io_threads=a.io_threads, threads=a.threads,
                     **{k: v for k, v in opts.items() if v is not None})
    load_s = time.perf_counter() - t1
    rss_load = rss_bytes()
    r = m.generate(a.prompt, max_tokens=a.tokens, temperature=0, ignore_eos=True)
    out = {"colibri": os.path.dirname(colibri.__file__), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "import_s": round(t1 - t0, 3), "load_s": round(load_s, 3),
           "rss_after_import_bytes": rss_import, "rss_after_load_bytes": rss_load, "rss_end_bytes": rss_bytes(),
           # the runtime baseline the engine measured at load: peak RSS stays within the limit plus it
           "runtime_baseline_rss_bytes": m.baseline_rss_bytes,
           **r.stats, "token_ids": r.token_ids, "text": r.text}
    if m.sparse is not None:  # --sparse-ffn (LOSSY): FFN sparsity and the bytes a chunked reader would need
        out["sparse_ffn"] = m.sparse.counters()
    m.close()
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- parent: cgroups, page cache, child processes

def own_memcg() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return MEMCG_ROOT / path.lstrip("/")
    raise RuntimeError("no cgroup-v1 memory controller in /proc/self/cgroup")


def swap_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_ticks(exclude: set[int]) -> dict[int, int]:
    """utime + stime (clock ticks) of every process but `exclude`."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) not in exclude:
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(d.name)] = int(f[11]) + int(f[12])
            except (OSError, IndexError, ValueError):
                pass
    return out


def busy_between(before: dict[int, int], after: dict[int, int], seconds: float) -> dict[int, str]:
    """Processes that used over 20 % of a core between two cpu_ticks() snapshots: pid -> command line."""
    hz, out = os.sysconf("SC_CLK_TCK"), {}
    for pid, t in after.items():
        if (t - before.get(pid, t)) / hz / seconds > 0.2:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            out[pid] = cmd[:80].strip()
    return out


def wait_idle(limit_s: float) -> float:
    """Wait (up to limit_s) until no other process keeps a core busy for 2 s; returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        a = cpu_ticks({os.getpid()})
        time.sleep(2)
        if not busy_between(a, cpu_ticks({os.getpid()}), 2) or time.perf_counter() - t0 >= limit_s:
            return round(time.perf_counter() - t0, 1)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def disk_of(path: str) -> str:
    """'MAJ:MIN' of the whole disk holding `path` (a blkio throttle rule names the disk, not a partition)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    node = Path("/sys/dev/block") / dev
    if not node.exists():
        raise RuntimeError(f"{path} is not on a block device (device {dev}: an overlay or network filesystem?)")
    if (node / "partition").exists():
        dev = (node.resolve().parent / "dev").read_text().strip()
    return dev


class ReadCap:
    """A child blkio cgroup (cgroup v1) whose processes read the disk holding `path` at most `bps` bytes a second
    (blkio.throttle.read_bps_device): the project's slow-disk kind of machine (1-2 GB/s) on a host-cached one. The
    block layer throttles every read of the disk, O_DIRECT and page-cache misses (an mmap-ing peer's faults)
    alike, so Colibri and a peer meet the same disk. Removed on exit."""

    def __init__(self, path: str, bps: int):
        self.bps = bps
        self.path = BLKIO_ROOT / f"colibri-read-cap-{os.getpid()}"
        if not (BLKIO_ROOT / "blkio.throttle.read_bps_device").exists():
            raise RuntimeError(f"no cgroup-v1 blkio throttle at {BLKIO_ROOT}")
        rule = f"{disk_of(path)} {bps}"
        self.path.mkdir()
        try:
            (self.path / "blkio.throttle.read_bps_device").write_text(rule + "\n")
        except BaseException:
            self.path.rmdir()
            raise

    def entering(self):
        return entering(self.path)

    def remove(self) -> None:
        for _ in range(50):  # the processes in it have exited (MemCG.remove killed any left) a moment ago
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove {self.path}", file=sys.stderr)


def entering_all(*groups):
    """One preexec_fn that enters every given cgroup (None: skipped)."""
    fns = [g.entering() for g in groups if g is not None]

    def enter() -> None:
        for fn in fns:
            fn()
    return enter if fns else None


def run_child(cmd: list[str], cg: "MemCG | None", cap: ReadCap | None = None) -> tuple[list[dict], int]:
    """Run a benchmark's child process (inside `cg` after a page-cache drop, if given, and under the read cap
    `cap`); return the JSON objects it printed, one per line, and its exit status (its stderr tail is shown if it
    failed)."""
    if cg is not None:
        drop_caches()
    print(f"loadavg before: {os.getloadavg()[0]:.2f} (a shared machine distorts timings)", file=sys.stderr)
    p = subprocess.run(cmd, preexec_fn=entering_all(cg, cap), capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stderr[-3000:], file=sys.stderr)
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")], p.returncode


def entering(cgroup: Path):
    """A preexec_fn that moves the forked child into the cgroup-v1 group at `cgroup` before exec."""
    procs = str(cgroup / "cgroup.procs")

    def enter() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    return enter


class MemCG:
    """A child memory cgroup of ours; removed on exit (processes in it are killed first)."""

    def __init__(self, parent: Path, name: str, limit: int | None):
        self.path = parent / name
        self.path.mkdir()
        try:
            if limit is not None:
                self.write("memory.limit_in_bytes", limit)
                if swap_total() and self.has("memory.memsw.limit_in_bytes"):
                    # No escape into swap either. Only with swap: once memsw is limited, charges fail on the memsw
                    # counter first, and on this kernel neither memory.failcnt nor memsw.failcnt then counts them.
                    self.write("memory.memsw.limit_in_bytes", limit)
        except BaseException:
            self.remove()
            raise

    def write(self, name: str, value) -> None:
        (self.path / name).write_text(f"{value}\n")

    def has(self, name: str) -> bool:
        return (self.path / name).exists()

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def stat(self) -> dict[str, int]:
        return {k: int(v) for k, v in (line.split() for line in self.read("memory.stat").splitlines())}

    def oom_kills(self) -> int:
        for line in self.read("memory.oom_control").splitlines():
            k, v = line.split()
            if k == "oom_kill":
                return int(v)
        return -1  # older kernels do not count

    def entering(self):
        """A preexec_fn that moves the forked child into this cgroup before exec: all its memory is charged here."""
        return entering(self.path)

    def remove(self) -> None:
        if not self.path.exists():
            return
        for _ in range(50):
            pids = [int(p) for p in self.read("cgroup.procs").split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        try:
            self.write("memory.force_empty", 0)  # release the page cache charged here
        except OSError:
            pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove {self.path}", file=sys.stderr)


def run_config(a: argparse.Namespace, cg_limit: int | None, mem_limit: int | None, idx: int) -> dict:
    # Other processes competing for the 2 cores or the disk make the figures meaningless: record them.
    res: dict = {"cgroup_limit_bytes": cg_limit, "memory_limit_bytes": mem_limit,
                 "loadavg_1m_before": round(os.getloadavg()[0], 2)}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", a.model, "--tokens", str(a.tokens),
           "--prompt", a.prompt, "--io-threads", str(a.io_threads), "--threads", str(a.threads),
           "--memory-limit", str(mem_limit) if mem_limit is not None else "none"]
    for opt in ("prefetch_depth", "ctx_length", "draft_tokens", "sparse_ffn"):
        if getattr(a, opt) is not None:
            cmd += [f"--{opt.replace('_', '-')}", str(getattr(a, opt))]
    if a.wait_idle:
        res["waited_for_idle_s"] = wait_idle(a.wait_idle)
    cg = MemCG(own_memcg(), f"colibri-limited-{os.getpid()}-{idx}", cg_limit)
    try:
        drop_caches()
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=cg.entering())
        peak = {"rss": 0, "cache": 0, "shmem": 0}
        out_err: dict = {}

        def reader(name, stream):
            out_err[name] = stream.read()

        ts = [threading.Thread(target=reader, args=(n, s), daemon=True)
              for n, s in (("out", p.stdout), ("err", p.stderr))]
        for t in ts:
            t.start()
        busy: dict[int, str] = {}
        mine = {os.getpid(), p.pid}
        ticks, t_ticks, n = cpu_ticks(mine), time.perf_counter(), 0
        while p.poll() is None:
            n += 1
            if n % 10 == 0:  # every ~2 s: did anything else compete for the cores?
                now_ticks, now = cpu_ticks(mine), time.perf_counter()
                busy.update(busy_between(ticks, now_ticks, now - t_ticks))
                ticks, t_ticks = now_ticks, now
            try:
                # "rss": private anonymous memory; "cache": page cache plus shmem. Shared anonymous mappings
                # (Python's mmap.mmap(-1, n)) are shmem: counted under "cache" yet not reclaimable without swap.
                s = cg.stat()
                for k in peak:
                    peak[k] = max(peak[k], s.get(k, 0))
            except OSError:
                pass
            time.sleep(0.2)
        for t in ts:
            t.join()
        res["wall_s"] = round(time.perf_counter() - t0, 2)
        res["busy_other_processes"] = [f"{pid} {cmd}" for pid, cmd in busy.items()]
        res["exit_code"] = p.returncode
        res["cgroup_max_usage_bytes"] = int(cg.read("memory.max_usage_in_bytes"))
        res["cgroup_failcnt"] = int(cg.read("memory.failcnt"))
        res["cgroup_memsw_failcnt"] = (int(cg.read("memory.memsw.failcnt")) if cg.has("memory.memsw.failcnt")
                                       else None)
        res["cgroup_oom_kills"] = cg.oom_kills()
        res["cgroup_peak_rss_sampled_bytes"] = peak["rss"]
        res["cgroup_peak_cache_sampled_bytes"] = peak["cache"]
        res["cgroup_peak_shmem_sampled_bytes"] = peak["shmem"]
        res["oom_killed"] = p.returncode == -signal.SIGKILL or res["cgroup_oom_kills"] > 0
        stdout, stderr = out_err.get("out", ""), out_err.get("err", "")
        if p.returncode == 0:
            res.update(json.loads(stdout.strip().splitlines()[-1]))
            res["ok"] = True
        else:
            res["ok"] = False
            res["error"] = ("OOM-killed (SIGKILL, exit -9) by the cgroup memory limit" if res["oom_killed"]
                            else f"child exited with status {p.returncode}")
            res["stderr_tail"] = stderr.strip()[-2000:]
    finally:
        cg.remove()
    return res


def summary(r: dict) -> str:
    head = f"cgroup {fmt_size(r['cgroup_limit_bytes']):>5} | memory_limit {fmt_size(r['memory_limit_bytes']):>5} | "
    memsw = r.get("cgroup_memsw_failcnt")
    cgs = (f"cgroup max {r['cgroup_max_usage_bytes'] / 2**20:.0f} MiB, failcnt {r['cgroup_failcnt']}"
           + (f" (memsw {memsw})" if memsw is not None else "") + f", oom_kill {r['cgroup_oom_kills']}")
    if not r["ok"]:
        last = r.get("stderr_tail", "").splitlines()[-1:] or [""]
        return head + f"FAILED: {r['error']}; {cgs}" + (f"; {last[0]}" if last[0] else "")
    return (head + f"decode {r['decode_tokens_per_s']:.2f} tok/s | TTFT {r['ttft_s']:.2f} s | "
            f"load {r['load_s']:.1f} s | read {r['disk_bytes_read'] / 2**20:.0f} MiB, "
            f"I/O wait {r['io_wait_s']:.1f} s | "
            f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB (after import {r['rss_after_import_bytes'] / 2**20:.0f}, "
            f"after load {r['rss_after_load_bytes'] / 2**20:.0f}){within(r)} | {cgs}")


def within(r: dict) -> str:
    """Peak RSS against the rule: within the memory limit plus the runtime baseline the engine measured."""
    base, limit = r.get("runtime_baseline_rss_bytes"), r.get("memory_limit_bytes")
    if base is None or limit is None:
        return ""
    above, over = r["peak_rss_bytes"] - base, r["peak_rss_bytes"] - base - limit
    verdict = f"{-over / 2**20:.1f} MiB within the limit" if over <= 0 else f"OVER the limit by {over / 2**20:.1f} MiB"
    return f", baseline {base / 2**20:.0f} MiB: peak - baseline {above / 2**20:.0f} MiB, {verdict}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Colibri container directory")
    ap.add_argument("--cgroup-limit", help="whole-process limit incl. page cache, e.g. 800M (default: none)")
    ap.add_argument("--memory-limit", help="the engine's own budget (colibri.load's memory_limit), e.g. 500M "
                    "(default: none, all in RAM)")
    ap.add_argument("--config", action="append", metavar="CGROUP,MEMORY",
                    help="a configuration, e.g. 800M,500M or none,none (repeatable; overrides the two above)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--prefetch-depth", type=int, help="streamed pages read ahead (default: the engine's)")
    ap.add_argument("--ctx-length", type=int, help="context length (default: the engine's)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads (default 2)")
    ap.add_argument("--draft-tokens", type=int, help="speculation's draft length; 0 turns it off (default: the "
                    "engine's adaptive drafts)")
    ap.add_argument("--sparse-ffn", metavar="SIDECAR", help="LOSSY sparse FFN (colibri.load's sparse_ffn): the"
                    " sidecar, or `default` for the container's own")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each run wait up to this long until no other process keeps a core busy")
    ap.add_argument("--retry-busy", type=int, default=0, metavar="N",
                    help="rerun a configuration up to N times while other busy processes disturbed it")
    ap.add_argument("--json-out", help="also write the JSON result to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return

    if os.geteuid() != 0 or not MEMCG_ROOT.is_dir():
        print("needs root and the cgroup-v1 memory controller at /sys/fs/cgroup/memory", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the child and its cgroup are removed
    if a.config:
        configs = []
        for c in a.config:
            cg, _, ml = c.partition(",")
            configs.append((parse_size(cg), parse_size(ml)))
    else:
        configs = [(parse_size(a.cgroup_limit), parse_size(a.memory_limit))]
    print(f"model {a.model}; {a.tokens} tokens greedy; threads {a.threads}, io_threads {a.io_threads}, "
          f"prefetch_depth {a.prefetch_depth or 'default'}, ctx_length {a.ctx_length or 'default'}; "
          "page cache dropped before each run", flush=True)
    results = []
    for i, (cg, ml) in enumerate(configs):
        for attempt in range(a.retry_busy + 1):
            r = run_config(a, cg, ml, i)
            r["attempt"] = attempt + 1
            if not r.get("busy_other_processes") or attempt == a.retry_busy:
                break
            print(summary(r) + f"\n  other busy processes: {'; '.join(r['busy_other_processes'])}; retrying",
                  flush=True)
        results.append(r)
        print(summary(r), flush=True)
        if r.get("busy_other_processes"):
            print(f"  WARNING: other busy processes during this run (figures unreliable): "
                  f"{'; '.join(r['busy_other_processes'])}", flush=True)

    done = [r for r in results if r["ok"]]
    same = len({tuple(r["token_ids"]) for r in done}) <= 1
    if len(done) > 1:
        print(f"generated tokens {'IDENTICAL' if same else 'DIFFER'} across the {len(done)} completed "
              "configurations")
        if not same:
            ref = done[0]["token_ids"]
            for r in done[1:]:
                k = next((j for j, (x, y) in enumerate(zip(ref, r["token_ids"])) if x != y),
                         min(len(ref), len(r["token_ids"])))
                print(f"  cgroup {fmt_size(r['cgroup_limit_bytes'])} memory_limit "
                      f"{fmt_size(r['memory_limit_bytes'])}: first difference at token {k}")
    if done:
        print("text:", json.dumps(done[0]["text"]))
    report = {"model": a.model, "tokens": a.tokens, "prompt": a.prompt, "threads": a.threads,
              "io_threads": a.io_threads, "prefetch_depth": a.prefetch_depth, "ctx_length": a.ctx_length,
              "tokens_identical": same,
              "results": results}
    text = json.dumps(report)
    print(text)
    if a.json_out:
        Path(a.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
