"""Run any command with its whole process tree confined by a cgroup-v1 memory limit, from a cold page cache.

    python benchmarks/in_cgroup.py --limit 800M -- python benchmarks/prefill.py --model DIR --memory-limit 500M
    python benchmarks/in_cgroup.py --limit 800M -- llama-bench -m model.gguf -t 2 -p 512 -n 0
    python benchmarks/in_cgroup.py --limit 800M --read-bps 1.5G --read-path model.gguf -- llama-bench ...

For peers and scripts that have no cgroup handling of their own (benchmarks/limited.py and batch.py make theirs).
The limit is `memory.limit_in_bytes`, which charges page cache as well as anonymous memory, so an mmap-ing peer
is held to the same machine as Colibri. The page cache is dropped first (every weight comes from disk). The
command's output passes through; afterwards one line on stderr gives the cgroup's peak use, failcnt and OOM
kills, and the exit status is the command's. Needs root and the cgroup-v1 memory controller.

--read-bps caps the command's reads of the disk holding --read-path (default: the current directory) at that
many bytes a second (binary units as --limit: 1.4G is 1.50 GB/s; limited.py's ReadCap, a blkio throttle): the
slow-disk kind of machine on a host-cached disk.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from limited import MemCG, ReadCap, drop_caches, entering_all, own_memcg, parse_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", required=True, help="whole-process limit incl. page cache, e.g. 800M")
    ap.add_argument("--keep-cache", action="store_true", help="do not drop the page cache first")
    ap.add_argument("--read-bps", help="cap reads of the disk holding --read-path at this many bytes/s, e.g. 1.5G")
    ap.add_argument("--read-path", default=".", help="a file on the disk to cap (default: the current directory)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command to run after --")
    try:
        cg = MemCG(own_memcg(), f"colibri-in-cgroup-{os.getpid()}", parse_size(a.limit))
    except (OSError, RuntimeError) as e:
        print(f"error: cannot make a memory cgroup ({e}); run as root on a cgroup-v1 machine", file=sys.stderr)
        return 2
    try:
        cap = ReadCap(a.read_path, parse_size(a.read_bps)) if a.read_bps else None
    except (OSError, RuntimeError) as e:
        cg.remove()
        print(f"error: cannot cap reads ({e}); run as root on a cgroup-v1 machine with the blkio controller",
              file=sys.stderr)
        return 2
    try:
        if not a.keep_cache:
            drop_caches()
        rc = subprocess.run(cmd, preexec_fn=entering_all(cg, cap)).returncode
        capped = f", reads capped at {cap.bps / 1e9:.2f} GB/s" if cap else ""
        print(f"cgroup {a.limit}{capped}: max usage {int(cg.read('memory.max_usage_in_bytes')) / 2**20:.0f} MiB, "
              f"failcnt {cg.read('memory.failcnt').strip()}, oom_kill {cg.oom_kills()}, exit {rc}", file=sys.stderr)
        return rc
    finally:
        cg.remove()
        if cap is not None:
            cap.remove()


if __name__ == "__main__":
    sys.exit(main())
