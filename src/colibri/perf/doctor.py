"""`colibri doctor`: checks of this machine for streaming a model, each a one-line verdict and what to do.

The checks read the machine through a `Host` (its fields are the functions that read /proc, /sys, the disk and
the kernels' listing); a test hands in its own to fake a filesystem without O_DIRECT or a THP mode of `never`.
Each check returns a `Check`: status ("ok", "warn", "fail" or "info"), the verdict, the action, the figures.

The read probe is O_DIRECT on the model's own data file (io.probe_bandwidth, as `colibri plan` measures), twice
over the same bytes: the first pass is as cold as this process can make it (O_DIRECT bypasses this kernel's page
cache, but not a VM host's cache or the drive's), the repeat is cached wherever anything below caches. A repeat
much faster than the first pass means the host caches the disk: the first-pass figure is the one to plan with,
and even it is optimistic once the model is larger than the host's cache. A file smaller than what the probe
reads is read more than once within a pass, so both figures are cached ones, and the verdict says so.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from colibri import kernels
from colibri.core.defaults import cache_dir
from colibri.core.errors import ColibriError, InputError
from colibri.core.metrics import cgroup_memory_limit
from colibri.formats.container import MANIFEST, VERSION, ContainerCheckpoint, range_checksum
from colibri.kv.swap import DISK_RESERVE
from colibri.weights.io import ALIGN, AlignedBuffer, probe_bandwidth, thp_mode

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
PROBE_SECONDS = 1.0  # each of the two read passes
CACHED_RATIO = 1.5  # a repeat this much faster than the first pass: something below this kernel caches the file
SAMPLE_PAGES = 8  # container pages whose checksums the quick check recomputes (first, last and random ones)
SAMPLE_BYTES = 256 << 20  # at most this many bytes of them


@dataclass
class Check:
    name: str
    status: str  # OK | WARN | FAIL | INFO
    verdict: str
    action: str = ""  # what to do; empty when nothing needs doing
    data: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"[{self.status:>4}] {self.name}: {self.verdict}" + (f" -> {self.action}" if self.action else "")


def _open_direct(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


def read_meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where absent)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def fs_type(path: str) -> str | None:
    """The filesystem type of the mount holding `path` (the longest mount point prefix in /proc/mounts)."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        return None
    return kind


def block_size(path: str) -> int | None:
    """The logical block size of the device holding `path` (what O_DIRECT must align to), None where unknown
    (a virtual filesystem, no /sys)."""
    st = os.stat(path)
    base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for q in (base / "queue", base / ".." / "queue"):  # a partition's queue is its disk's
        try:
            return int((q / "logical_block_size").read_text())
        except (OSError, ValueError):
            continue
    return None


def virtual_disk(path: str) -> bool:
    """Whether the device holding `path` is a virtual one (virtio, xen, a loop or device-mapper stack): its host
    may serve reads from its own cache, whatever this kernel does."""
    st = os.stat(path)
    try:
        dev = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    except OSError:
        return False
    return any(k in dev for k in ("virtio", "xen", "/virtual/", "vmbus"))


@dataclass
class Host:
    """Where the checks read the machine: each field a function (a test passes its own)."""

    open_direct: Callable[[str], int] = _open_direct  # path -> fd opened with O_DIRECT, or OSError
    fs_type: Callable[[str], str | None] = fs_type
    block_size: Callable[[str], int | None] = block_size
    virtual_disk: Callable[[str], bool] = virtual_disk
    thp_mode: Callable[[], str | None] = thp_mode
    meminfo: Callable[[], dict] = read_meminfo
    cgroup_limit: Callable[[], int | None] = cgroup_memory_limit
    kernels: Callable[[], dict] = kernels.describe
    disk_usage: Callable = shutil.disk_usage
    bandwidth: Callable = probe_bandwidth  # (path, seconds=...) -> bytes/s


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_direct_io(path: str, host: Host) -> Check:
    """O_DIRECT on `path`'s filesystem: opens, reads 4096 aligned bytes, and the device's block size divides the
    4096 the reader aligns to."""
    fs = host.fs_type(path) or "unknown"
    lbs = host.block_size(path)
    data = {"file": path, "filesystem": fs, "logical_block_size": lbs, "align": ALIGN}
    try:
        fd = host.open_direct(path)
    except OSError as e:
        if e.errno != errno.EINVAL:
            return Check("O_DIRECT", FAIL, f"cannot open {path}: {e.strerror}", "check the path and permissions",
                         data)
        return Check("O_DIRECT", FAIL, f"the {fs} filesystem refuses O_DIRECT: streamed weights would be read"
                     " through the page cache (slower, and the cache competes with the memory limit)",
                     "keep the model on a local ext4 or xfs disk (not tmpfs, overlay or a network share)", data)
    try:
        buf = AlignedBuffer(ALIGN)
        os.preadv(fd, [buf.memoryview()], 0)
    except OSError as e:
        return Check("O_DIRECT", FAIL, f"the {fs} filesystem accepts O_DIRECT but an aligned read fails"
                     f" ({e.strerror})", "keep the model on a local ext4 or xfs disk", data)
    finally:
        os.close(fd)
    if lbs is not None and ALIGN % lbs:
        return Check("O_DIRECT", FAIL, f"the device's logical block size is {lbs} bytes, which does not divide"
                     f" the {ALIGN}-byte alignment of Colibri's reads", "use a disk with 512- or 4096-byte blocks",
                     data)
    size = f"{lbs}-byte blocks" if lbs else "block size unknown (virtual device)"
    return Check("O_DIRECT", OK, f"supported on {fs} ({size}; reads aligned to {ALIGN})", "", data)


def check_read_speed(path: str, host: Host, seconds: float = PROBE_SECONDS) -> Check:
    """Sequential O_DIRECT read rate of `path`: first pass and repeat over the same bytes (module docstring)."""
    size = os.path.getsize(path)
    first = host.bandwidth(path, seconds=seconds)
    repeat = host.bandwidth(path, seconds=seconds)
    data = {"file": path, "file_bytes": size, "first_pass_bytes_per_s": round(first),
            "repeat_bytes_per_s": round(repeat), "seconds": seconds}
    figures = f"first pass {first / 1e9:.2f} GB/s, repeat {repeat / 1e9:.2f} GB/s"
    if first * seconds > size:
        data["verdict"] = "cached"
        return Check("disk read", INFO, f"{figures}, both cached: the file ({_size(size)}) is smaller than one"
                     " pass reads, so it was read again from a cache", "run doctor with --model on a model of"
                     " several GB for the disk's own rate", data)
    if repeat > CACHED_RATIO * first:
        data["verdict"] = "host-cached"
        return Check("disk read", WARN, f"{figures}: the repeat is served from a cache below this kernel (a VM"
                     " host's page cache or the drive's); the first pass is the nearer figure, and optimistic"
                     " once the model is larger than that cache", "plan with the first-pass figure (colibri plan"
                     " measures the same way)", data)
    if host.virtual_disk(path):
        data["verdict"] = "cold or host-cached"
        age = (time.time() - os.stat(path).st_mtime) / 3600
        return Check("disk read", INFO, f"{figures}: no faster on repeat, but this is a virtual disk whose host may"
                     f" cache it (the file was written {age:.1f} h ago): recently read or written data may come from"
                     " the host's cache in both passes", "plan with these figures for a model read often; a file"
                     " untouched for days reads at the physical disk's rate, which may be lower", data)
    data["verdict"] = "cold"
    return Check("disk read", OK, f"{figures}: no faster on repeat, so nothing below this kernel caches the file:"
                 " the disk's own rate", "", data)


def check_thp(host: Host) -> Check:
    mode = host.thp_mode()
    data = {"mode": mode}
    if mode is None:
        return Check("huge pages", INFO, "transparent huge pages: mode unknown (no"
                     " /sys/kernel/mm/transparent_hugepage)", "", data)
    if mode == "never":
        return Check("huge pages", WARN, "transparent huge pages are off ('never'): staging buffers and resident"
                     " weights get 4 KiB pages; O_DIRECT reads into them are slower and vary by buffer, and a"
                     " decode step reads resident weights a few per cent slower",
                     "as root: echo madvise > /sys/kernel/mm/transparent_hugepage/enabled", data)
    return Check("huge pages", OK, f"transparent huge pages '{mode}': staging buffers and resident weights get 2 MiB"
                 " pages", "", data)


def check_memory(host: Host, model_bytes: int | None) -> Check:
    info = host.meminfo()
    total, avail = info.get("MemTotal"), info.get("MemAvailable")
    limit = host.cgroup_limit()
    data = {"mem_total": total, "mem_available": avail, "cgroup_limit": limit}
    if avail is None:
        return Check("memory", INFO, "free RAM unknown (no /proc/meminfo)", "", data)
    usable = min(avail, limit) if limit else avail
    data["usable"] = usable
    group = f"; cgroup limit {_size(limit)}" if limit else "; no cgroup memory limit"
    verdict = f"{_size(avail)} available of {_size(total or avail)}{group}"
    if limit and limit < avail:
        verdict += " (the cgroup limit is the one that binds)"
    if model_bytes is None:
        return Check("memory", INFO, verdict, "", data)
    if model_bytes < 0.8 * usable:
        return Check("memory", OK, f"{verdict}; the model ({_size(model_bytes)}) fits in RAM", "", data)
    return Check("memory", WARN, f"{verdict}; the model ({_size(model_bytes)}) does not fit beside the runtime",
                 f"run with --memory-limit under {_size(0.8 * usable)}: the rest streams from disk", data)


def check_cpu(report: dict) -> Check:
    flags = report["cpu_flags"]
    have = [f for f, v in flags.items() if v]
    lacking = [f for f, v in flags.items() if not v]
    data = {"flags": flags}
    if not flags:
        return Check("CPU", INFO, "no x86 kernel flags to check on this CPU (the portable tier applies)", "", data)
    verdict = f"has {', '.join(have) or 'none of the flags'}" + (f"; lacks {', '.join(lacking)}" if lacking else "")
    if "avx2" in lacking:
        return Check("CPU", WARN, verdict + ": no AVX2, so the int4/int8 kernels run the portable tier",
                     "expect slower decode than on a CPU with AVX2", data)
    return Check("CPU", OK, verdict, "", data)


def check_torch() -> Check:
    import torch
    threads, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    data = {"version": torch.__version__, "threads": threads, "cores": cores, "cuda": torch.version.cuda}
    verdict = f"torch {torch.__version__}, {threads} threads on {cores} usable cores"
    if torch.version.cuda:
        return Check("torch", WARN, verdict + ": a CUDA build (Colibri computes on the CPU)",
                     "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu (far smaller)",
                     data)
    if threads > cores:
        return Check("torch", WARN, verdict + ": more threads than cores, which slows every kernel",
                     f"pass --threads {cores} (or unset OMP_NUM_THREADS)", data)
    return Check("torch", OK, verdict, "", data)


def check_kernels(report: dict) -> Check:
    pick = report["pick"]
    rows = {r["name"]: r for r in report["tiers"]}
    row = rows.get(pick["tier"])
    data = {"tier": pick["tier"], "why": pick["why"], "setting": report["setting"], "compiler": report["compiler"],
            "built": row["built"] if row else None}
    failed = [r["error"] for r in report["tiers"] if r["error"]]
    if pick["tier"] == "torch":
        status = INFO if report["setting"] == "torch" else WARN
        return Check("kernels", status, f"torch's kernels run ({pick['why']})",
                     "" if status == INFO else "install a C++ compiler (g++) so the native tiers can build;"
                     " `colibri kernels` lists them", data)
    built = "built" if row["built"] else "not built yet (built at first use)"
    status = FAIL if failed else OK
    verdict = f"{pick['tier']} tier, {built}: {pick['why']}"
    if failed:
        verdict += "; build failures: " + "; ".join(failed)
    return Check("kernels", status, verdict, "colibri kernels --build shows the compiler's error" if failed else
                 ("" if row["built"] else "colibri kernels --build builds it now"), data)


def check_swap_disk(directory: str, host: Host) -> Check:
    usage = host.disk_usage(directory)
    room = max(0, usage.free - DISK_RESERVE)
    data = {"dir": directory, "free": usage.free, "usable_for_swap": room}
    verdict = f"{_size(usage.free)} free on {directory}"
    if room <= 0:
        return Check("swap disk", WARN, verdict + f": nothing left for a KV swap file beside the {_size(DISK_RESERVE)}"
                     " kept free", "free disk space, or give --swap a file on another disk", data)
    return Check("swap disk", OK, f"{verdict}: room for a KV swap file of up to {_size(room)}", "", data)


def check_container(path: Path, sample: int = SAMPLE_PAGES, seed: int = 0) -> Check:
    """The container's version, and the checksums of a sample of its pages (first, last, random ones)."""
    try:
        ckpt = ContainerCheckpoint(path)
    except ColibriError as e:
        return Check("container", FAIL, str(e), "reconvert the model (colibri convert)")
    try:
        version = ckpt.manifest["version"]
        pages = ckpt.pages
        rng = random.Random(seed)
        picked = {0, len(pages) - 1, *rng.sample(range(len(pages)), min(len(pages), sample))} if pages else set()
        chosen, nbytes = [], 0
        for i in sorted(picked, key=lambda i: (i not in (0, len(pages) - 1), i)):
            if chosen and nbytes + pages[i].nbytes > SAMPLE_BYTES:
                continue
            chosen.append(pages[i])
            nbytes += pages[i].nbytes
        bad = [p.id for p in chosen if range_checksum(lambda o, n, p=p: ckpt.read_extent(p.file, o, n).numpy(),
                                                      p.offset, p.nbytes) != p.checksum]
    finally:
        ckpt.close()
    data = {"version": version, "pages": len(pages), "checked_pages": [p.id for p in chosen], "checked_bytes": nbytes,
            "bad_pages": bad}
    head = f"version {version}" + ("" if version == VERSION else f" (this Colibri writes {VERSION})")
    if bad:
        return Check("container", FAIL, f"{head}; pages {bad} fail their checksums", "run colibri verify for the"
                     " full list, then reconvert the model", data)
    return Check("container", OK, f"{head}; {len(chosen)} of {len(pages)} pages ({_size(nbytes)}) pass their"
                 " checksums (a sample)", "colibri verify checks every page" if len(chosen) < len(pages) else "",
                 data)


def data_file(model: Path) -> str | None:
    """The file the disk checks read: a container's largest data file, or the checkpoint file itself."""
    if model.is_file():
        return str(model)
    if (model / MANIFEST).is_file():
        files = [f for f in model.iterdir() if f.is_file() and f.name != MANIFEST]
        return str(max(files, key=lambda f: f.stat().st_size)) if files else None
    files = sorted(model.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    return str(files[-1]) if files else None


def diagnose(model: str | Path | None = None, directory: str | Path | None = None, host: Host | None = None,
             probe_seconds: float = PROBE_SECONDS) -> list[Check]:
    """Every check. Without a model the disk checks use a scratch file in `directory` (default: Colibri's cache
    directory, where swap files go) and the container check is skipped."""
    host = host or Host()
    checks: list[Check] = []
    model_bytes = None
    target = None
    if model is not None:
        model = Path(model)
        if not model.exists():
            raise InputError(f"--model {model}: no such file or directory")
        target = data_file(model)
        model_bytes = (model.stat().st_size if model.is_file() else
                       sum(f.stat().st_size for f in model.iterdir() if f.is_file()))
    swap_dir = directory
    directory = str(directory or (model if model is not None and model.is_dir() else
                                  model.parent if model is not None else cache_dir()))
    os.makedirs(directory, exist_ok=True)
    scratch = None
    if target is None:  # a file of our own on the filesystem in question
        scratch = Path(directory) / f".colibri-doctor-{os.getpid()}"
        scratch.write_bytes(os.urandom(4 * ALIGN))
        target = str(scratch)
    try:
        checks.append(check_direct_io(target, host))
        if scratch is None:
            checks.append(check_read_speed(target, host, probe_seconds))
        else:
            checks.append(Check("disk read", INFO, "not measured: give --model to time reads of its own file", ""))
    finally:
        if scratch is not None:
            scratch.unlink(missing_ok=True)
    checks.append(check_thp(host))
    checks.append(check_memory(host, model_bytes))
    report = host.kernels()
    checks.append(check_cpu(report))
    checks.append(check_torch())
    checks.append(check_kernels(report))
    swap_dir = Path(swap_dir or cache_dir())
    swap_dir.mkdir(parents=True, exist_ok=True)
    checks.append(check_swap_disk(str(swap_dir), host))
    if model is not None and model.is_dir() and (model / MANIFEST).is_file():
        checks.append(check_container(model))
    elif model is not None:
        checks.append(Check("container", INFO, f"{model.name} is not a Colibri container: it is read whole into RAM",
                            "colibri convert it to stream it under --memory-limit"))
    return checks


def as_json(checks: list[Check]) -> dict:
    from colibri.core import __version__
    return {"colibri": __version__, "python": sys.version.split()[0], "checks": [asdict(c) for c in checks]}


def format_checks(checks: list[Check]) -> str:
    from colibri.core import __version__
    worst = max((c.status for c in checks), key=[INFO, OK, WARN, FAIL].index, default=OK)
    lines = [f"colibri {__version__} doctor"] + [c.line() for c in checks]
    counts = {s: sum(c.status == s for c in checks) for s in (FAIL, WARN)}
    lines.append("all checks pass" if worst in (OK, INFO) else
                 f"{counts[FAIL]} failing, {counts[WARN]} warning")
    return "\n".join(lines)
