"""One metrics object for every number a user sees (CLI summary, API stats, later the server)."""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a huge number (page-rounded 2^63 - 1)


def rss_bytes() -> int:
    """Current resident set size of this process (Linux; 0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def cgroup_memory_limit() -> int | None:
    """This process's cgroup memory limit in bytes (v2 memory.max, else v1 memory.limit_in_bytes), None if none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            candidates = [f"/sys/fs/cgroup{path}/memory.max"]
        elif "memory" in controllers.split(","):
            candidates = [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"]
        else:
            continue
        for c in candidates:
            try:
                text = Path(c).read_text().strip()
            except OSError:
                continue
            if text == "max" or int(text) >= UNLIMITED:
                continue
            return int(text)
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process. On Linux VmHWM (of this program's own memory: ru_maxrss keeps the
    peak of the process image before exec, e.g. a large parent that forked it); else ru_maxrss (KiB on Linux,
    bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


# store counter -> GenerationMetrics field, for the flows (bytes, seconds, counts) a step adds
IO_FLOWS = {"bytes_read": "disk_bytes_read", "io_wait_s": "io_wait_s", "read_active_s": "read_s",
            "hits": "page_hits", "misses": "page_misses", "hit_bytes": "hit_bytes", "miss_bytes": "miss_bytes",
            "expert_hits": "expert_hits", "expert_misses": "expert_misses",
            "expert_pinned_uses": "expert_pinned_uses", "lookahead_correct": "lookahead_correct",
            "lookahead_routed": "lookahead_routed"}


@dataclass
class GenerationMetrics:
    prompt_tokens: int = 0
    prefix_tokens: int = 0  # prompt tokens not recomputed (already in the KV cache)
    prefill_computed: int = 0  # prompt tokens run through the model
    generated_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""
    disk_bytes_read: int = 0  # weight bytes read from disk during this generation (streaming store)
    io_wait_s: float = 0.0  # time the forward pass waited for those reads
    prefill_io_wait_s: float = 0.0  # the part of it during prefill
    read_s: float = 0.0  # wall time with a read in flight: achieved bandwidth = disk_bytes_read / read_s
    direct_io: bool | None = None  # O_DIRECT (True) or the buffered fallback; None: nothing streamed
    page_hits: int = 0  # uses of streamed pages served by an earlier read (cached experts); prefetched = miss
    page_misses: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_pinned_uses: int = 0
    lookahead_correct: int = 0  # routed experts the router lookahead had guessed (MoE under a limit)
    lookahead_routed: int = 0  # routed experts of the layers it guessed for
    pinned_bytes: int = 0
    cached_bytes: int = 0
    staging_bytes: int = 0
    staging_huge_fraction: float | None = None  # of the staging slots and head blocks, in huge pages (None: unknown)
    kv_ram_bytes: int = 0  # KV held in RAM (live window, scratch, cached prefixes)
    kv_disk_bytes: int = 0  # KV blocks in the swap file
    kv_read_bytes: int = 0  # KV read back from the swap file during this generation
    kv_written_bytes: int = 0
    kv_read_wait_s: float = 0.0
    prefill_kv_read_bytes: int = 0
    prefill_disk_bytes: int = 0  # the part of disk_bytes_read up to the first token
    draft_tokens: int = 0  # speculation: tokens drafted and verified in this generation's passes
    accepted_tokens: int = 0  # of those, the ones the model agreed with
    sampling_passes: int = 0  # forward passes that sampled tokens of this generation
    _t0: float = field(default_factory=time.perf_counter, repr=False)

    def account_io(self, start: dict, now: dict) -> None:
        """Take a streaming store's counters: differences since `start` for the flows, `now` for the levels."""
        for dst in IO_FLOWS.values():
            setattr(self, dst, 0.0 if isinstance(getattr(self, dst), float) else 0)
        self.add_io(start, now)

    def add_io(self, start: dict, now: dict, share: float = 1.0) -> None:
        """Add `share` of the store's flows between two counter snapshots (one engine step, split among the
        sequences it served) and take the levels from `now`."""
        for src, dst in IO_FLOWS.items():
            d = (now[src] - start[src]) * share
            old = getattr(self, dst)
            setattr(self, dst, old + (d if isinstance(old, float) else round(d)))
        self.direct_io = now["direct_io"]
        self.pinned_bytes, self.cached_bytes, self.staging_bytes = (now["pinned_bytes"], now["cached_bytes"],
                                                                    now["staging_bytes"])
        self.staging_huge_fraction = now.get("staging_huge_fraction")

    def add_kv(self, start: dict, now: dict, share: float = 1.0) -> None:
        """The same for the KV space's counters."""
        self.kv_read_bytes += round((now["kv_read_bytes"] - start["kv_read_bytes"]) * share)
        self.kv_written_bytes += round((now["kv_written_bytes"] - start["kv_written_bytes"]) * share)
        self.kv_read_wait_s += (now["kv_read_wait_s"] - start["kv_read_wait_s"]) * share
        self.kv_ram_bytes, self.kv_disk_bytes = now["kv_ram_bytes"], now["kv_disk_bytes"]

    @property
    def kv_read_bytes_per_token(self) -> float:
        """KV read back from disk per decode step."""
        steps = self.generated_tokens - 1
        return (self.kv_read_bytes - self.prefill_kv_read_bytes) / steps if steps > 0 else 0.0

    @property
    def decode_split(self) -> tuple[float, float]:
        """(I/O wait, everything else) in seconds per decode step."""
        steps = self.generated_tokens - 1
        if steps <= 0 or self.decode_s <= 0:
            return 0.0, 0.0
        wait = max(0.0, self.io_wait_s - self.prefill_io_wait_s) / steps
        return wait, max(0.0, self.decode_s / steps - wait)

    @property
    def read_gb_per_s(self) -> float:
        return self.disk_bytes_read / self.read_s / 1e9 if self.read_s > 0 else 0.0

    @property
    def expert_resident_rate(self) -> float:
        """Routed expert uses served without a read for them: cache hits plus pinned experts."""
        uses = self.expert_hits + self.expert_misses + self.expert_pinned_uses
        return (self.expert_hits + self.expert_pinned_uses) / uses if uses else 0.0

    @property
    def expert_hit_rate(self) -> float:
        """Of the routed uses of streamed experts, those served by an earlier read (the expert cache)."""
        uses = self.expert_hits + self.expert_misses
        return self.expert_hits / uses if uses else 0.0

    @property
    def lookahead_recall(self) -> float:
        return self.lookahead_correct / self.lookahead_routed if self.lookahead_routed else 0.0

    @property
    def hit_rate(self) -> tuple[float, float]:
        """(by pages, by bytes) of the streamed pages needed: how many were already resident."""
        pages, nbytes = self.page_hits + self.page_misses, self.hit_bytes + self.miss_bytes
        return (self.page_hits / pages if pages else 0.0, self.hit_bytes / nbytes if nbytes else 0.0)

    def add_pass(self, drafted: int, accepted: int, tokens: int) -> None:
        """A pass sampled `tokens` tokens of this generation, verifying `drafted` draft tokens (`accepted` stood)."""
        self.sampling_passes += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Generated tokens per forward pass that sampled them (1 without speculation; the weight sweeps saved)."""
        return self.generated_tokens / self.sampling_passes if self.sampling_passes else 0.0

    @property
    def weight_bytes_per_token(self) -> float:
        """Weight bytes read from disk per decoded token (its share of each step's reads, prefill excluded)."""
        steps = self.generated_tokens - 1
        return (self.disk_bytes_read - self.prefill_disk_bytes) / steps if steps > 0 else 0.0

    def mark_first_token(self) -> None:
        self.ttft_s = time.perf_counter() - self._t0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_computed / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first generated token comes out of prefill; decode covers the steps after it.
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefix_tokens": self.prefix_tokens,
            "prefill_tokens_computed": self.prefill_computed,
            "generated_tokens": self.generated_tokens,
            "ttft_s": round(self.ttft_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "peak_rss_bytes": peak_rss_bytes(),
            "finish_reason": self.finish_reason,
            "disk_bytes_read": self.disk_bytes_read,
            "io_wait_s": round(self.io_wait_s, 6),
            "read_s": round(self.read_s, 6),
            "read_gb_per_s": round(self.read_gb_per_s, 3),
            "direct_io": self.direct_io,
            "page_hits": self.page_hits,
            "page_misses": self.page_misses,
            "hit_rate_pages": round(self.hit_rate[0], 4),
            "hit_rate_bytes": round(self.hit_rate[1], 4),
            "expert_hits": self.expert_hits,
            "expert_misses": self.expert_misses,
            "expert_pinned_uses": self.expert_pinned_uses,
            "expert_resident_rate": round(self.expert_resident_rate, 4),
            "expert_hit_rate": round(self.expert_hit_rate, 4),
            "lookahead_recall": round(self.lookahead_recall, 4),
            "pinned_bytes": self.pinned_bytes,
            "cached_bytes": self.cached_bytes,
            "staging_bytes": self.staging_bytes,
            "staging_huge_fraction": self.staging_huge_fraction,
            "kv_ram_bytes": self.kv_ram_bytes,
            "kv_disk_bytes": self.kv_disk_bytes,
            "kv_read_bytes": self.kv_read_bytes,
            "kv_read_bytes_per_token": round(self.kv_read_bytes_per_token),
            "kv_written_bytes": self.kv_written_bytes,
            "kv_read_wait_s": round(self.kv_read_wait_s, 6),
            "decode_io_wait_s_per_token": round(self.decode_split[0], 6),
            "decode_compute_s_per_token": round(self.decode_split[1], 6),
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "sampling_passes": self.sampling_passes,
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "weight_bytes_per_token": round(self.weight_bytes_per_token),
        }

    def summary(self) -> str:
        reused = f" ({self.prefix_tokens} reused)" if self.prefix_tokens else ""
        kv = (f" | KV on SSD {self.kv_disk_bytes / 2**20:.0f} MiB, read back {self.kv_read_bytes / 1e9:.2f} GB"
              if self.kv_disk_bytes or self.kv_read_bytes else "")
        return (f"{self.prompt_tokens} prompt{reused} + {self.generated_tokens} generated tokens | "
                f"TTFT {self.ttft_s:.3f} s | prefill {self.prefill_tokens_per_s:.1f} tok/s | "
                f"decode {self.decode_tokens_per_s:.2f} tok/s"
                + (f" ({self.tokens_per_pass:.2f} tokens/pass, {self.accepted_tokens}/{self.draft_tokens} drafted"
                   " accepted)" if self.draft_tokens else "")
                + f" | peak RSS {peak_rss_bytes() / 2**20:.0f} MiB"
                + (f" | SSD read {self.disk_bytes_read / 1e9:.2f} GB at {self.read_gb_per_s:.2f} GB/s"
                   f"{'' if self.direct_io else ' (buffered)'}, I/O wait {self.io_wait_s:.2f} s"
                   + (f", experts resident {100 * self.expert_resident_rate:.0f} %"
                      if self.expert_hits + self.expert_misses + self.expert_pinned_uses else "")
                   if self.disk_bytes_read else "") + kv)


def format_timeline(events: list[dict]) -> str:
    """The streaming store's per-scope timeline (--verbose): for each scope of the first passes, the pages it
    needed, the bytes read on demand (not prefetched), the wait for them and the compute inside the scope."""
    lines = [f"{'pass':>4} {'scope':<12} {'pages':>5} {'demand MiB':>10} {'wait ms':>9} {'compute ms':>10}"]
    for e in events:
        lines.append(f"{e['pass']:>4} {e['scope']:<12} {e['pages']:>5} {e['demand_bytes'] / 2**20:>10.1f} "
                     f"{e['wait_ms']:>9.2f} {e['compute_ms']:>10.2f}")
    return "\n".join(lines)
