"""One metrics object for every number a user sees (CLI summary, API stats, later the server)."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


@dataclass
class GenerationMetrics:
    prompt_tokens: int = 0
    prefix_tokens: int = 0  # prompt tokens not recomputed (already in the KV cache)
    generated_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""
    disk_bytes_read: int = 0  # weight bytes read from disk during this generation (streaming store)
    io_wait_s: float = 0.0  # time the forward pass waited for those reads
    _t0: float = field(default_factory=time.perf_counter, repr=False)

    def mark_first_token(self) -> None:
        self.ttft_s = time.perf_counter() - self._t0

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.prefix_tokens
        return computed / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first generated token comes out of prefill; decode covers the steps after it.
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefix_tokens": self.prefix_tokens,
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
        }

    def summary(self) -> str:
        return (f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens | "
                f"TTFT {self.ttft_s:.3f} s | prefill {self.prefill_tokens_per_s:.1f} tok/s | "
                f"decode {self.decode_tokens_per_s:.2f} tok/s | peak RSS {peak_rss_bytes() / 2**20:.0f} MiB"
                + (f" | disk read {self.disk_bytes_read / 2**20:.0f} MiB, I/O wait {self.io_wait_s:.2f} s"
                   if self.disk_bytes_read else ""))
