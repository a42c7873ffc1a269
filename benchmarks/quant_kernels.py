"""Time per `linear` call by pass size (rows T): the native batch-invariant kernels against torch's, and the
one-time q4 repack cost.

    python benchmarks/quant_kernels.py [--threads 2] [--repeat 9] [--shape 4096x4096] [--rows 1 2 4 ... 512]
    python benchmarks/quant_kernels.py --threads 1 --cpu-time     # thread CPU time: robust on a shared machine
    python benchmarks/quant_kernels.py --repack                    # the q4 layout's repack cost at load

Weights are N x K (out x in). Each call sees a different copy of the weight, enough copies to exceed the L3
cache at small T (so weights stream from RAM, as they do in the engine); the best of --repeat rounds is kept.
Columns, ms per call, bf16 x throughout:
  q4 int4mm   torch's `_weight_int4pack_mm_for_cpu` (g64) at every T: the torch fallback (COLIBRI_KERNELS=torch)
  q4 old      the previous default: int4mm below 128 rows, dequantize tiles + bf16 GEMM from 128 (not invariant)
  q4 new      colibri.kernels' native q4 kernel (the default)
  q8 int8mm   torch's `_weight_int8pack_mm` (per channel); q8 new: the native kernel
  q4 i8, q8 i8  the LOSSY int8-activation kernels (VNNI; `--lossy-int8-activations`), where the CPU has them
  bf16 torch  F.linear on a dense bf16 weight (oneDNN; not row-invariant); bf16 new: the native dense kernel
  x1 = q4 new at T / q4 new at T = 1;  /bf16 = q4 new / bf16 torch; i8 x1, i8 /bf16: the same for q4 i8.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from colibri import kernels
from colibri.quant.kinds import _pack_q4, _unpack_q4, kernel_layout_is_stored_layout, quantize, repack_for_kernel

ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
ROTATE_BYTES = 96 << 20  # > 32 MiB L3 of the target machines
OLD_GEMM_MIN_ROWS = 128  # the previous route's switch to dequantize + GEMM


def best_ms(fn, repeat: int, cpu: bool) -> float:
    clock = time.thread_time if cpu else time.perf_counter
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best * 1e3


def time_calls(make, nbytes: int, rows: int, call, repeat: int, cpu: bool) -> float:
    """Best per-call time of `call(w)`, cycling over copies of w so the set does not fit in cache (fewer copies
    at large T, where the arithmetic dominates and a round of calls would take seconds)."""
    n = max(1, min(-(-ROTATE_BYTES // nbytes), 256 // rows))
    copies = [make() for _ in range(n)]
    return best_ms(lambda: [call(w) for w in copies], repeat, cpu) / n


def clone_q(q):
    return lambda: type(q).from_buffers(q.shape, q.group_size, {k: v.clone() for k, v in q.buffers().items()})


def kernel_table(n: int, k: int, rows: list[int], repeat: int, cpu: bool, only: list[str] | None) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    wb = w.bfloat16()
    q4, q8 = quantize(w, "q4", 64), quantize(w, "q8", 0)
    nat = kernels.library()
    kernels.set_int8_activations(True)
    int8 = kernels.int8_activations()  # the ops are called directly below; this only checks VNNI

    def q4_int4mm(q, x):
        # the torch tier's own call: torch's int4 layout made at a weight's first call (the best of --repeat rounds
        # leaves that repack out)
        return q._torch_linear(x)

    def q4_old(q, x):
        return q4_int4mm(q, x) if x.shape[0] < OLD_GEMM_MIN_ROWS else q._dequant_matmul(x)

    def q4_new(q, x):
        b = q.buffers()
        return nat.q4_linear(x, b["qweight"], b["scales_zeros"], 64)

    def q8_int8mm(q, x):
        b = q.buffers()
        return torch.ops.aten._weight_int8pack_mm(x, b["qweight"], b["scales"])

    def q8_new(q, x):
        b = q.buffers()
        return nat.q8_linear(x, b["qweight"], b["scales"], 0)

    def q4_i8(q, x):
        b = q.buffers()
        return nat.q4_linear_i8(x, b["qweight"], b["scales_zeros"], 64)

    def q8_i8(q, x):
        b = q.buffers()
        return nat.q8_linear_i8(x, b["qweight"], b["scales"], 0)

    cols = {"q4 int4mm": (q4, q4_int4mm), "q4 old": (q4, q4_old), "q4 new": (q4, q4_new),
            "q8 int8mm": (q8, q8_int8mm), "q8 new": (q8, q8_new),
            **({"q4 i8": (q4, q4_i8), "q8 i8": (q8, q8_i8)} if int8 else {}),
            "bf16 torch": (wb, lambda w_, x: F.linear(x, w_)), "bf16 new": (wb, lambda w_, x: nat.dense_linear(x, w_))}
    if only:
        cols = {c: v for c, v in cols.items() if c in only or c in ("q4 new", "bf16 torch", "q4 i8")}
    print(f"\n{n} x {k}, ms per call ({'thread CPU time' if cpu else 'wall'}, best of {repeat})")
    extra = ["i8 x1", "i8 /bf16"] if int8 else []
    print(f"{'T':>4} " + " ".join(f"{c:>10}" for c in cols) + " ".join(f" {c:>8}" for c in ["x1", "/bf16"] + extra))
    t1 = t1i8 = None
    for t in rows:
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).bfloat16()
        row = {}
        for name, (wt, fn) in cols.items():
            make = wt.clone if isinstance(wt, torch.Tensor) else clone_q(wt)
            nbytes = wt.nbytes if isinstance(wt, torch.Tensor) else wt.nbytes
            row[name] = time_calls(make, nbytes, t, lambda w_: fn(w_, x), repeat, cpu)
        t1 = t1 or row["q4 new"]
        ratios = [row["q4 new"] / t1, row["q4 new"] / row["bf16 torch"]]
        if int8:
            t1i8 = t1i8 or row["q4 i8"]
            ratios += [row["q4 i8"] / t1i8, row["q4 i8"] / row["bf16 torch"]]
        print(f"{t:>4} " + " ".join(f"{row[c]:>10.3f}" for c in cols) + " ".join(f" {r:>8.2f}" for r in ratios),
              flush=True)


def plain_to_tiled(p: torch.Tensor) -> torch.Tensor:
    """Row-major nibbles uint8 [N, K/2] (value 2i low, 2i + 1 high) -> the stored tiled layout."""
    return _pack_q4(torch.stack([p & 0x0F, p >> 4], dim=-1).view(p.shape[0], -1))


def repack_table(shapes: list[str], repeat: int) -> None:
    """What a machine whose torch packs int4 differently pays at load (the torch fallback's int4 kernel wants its
    own layout there), and what storing plain row-major nibbles would cost on every machine."""
    print("\nq4 repack at load (qweight bytes; GB/s = qweight bytes / time)")
    print(f"{'N x K':>11} {'MB':>7} {'this machine ms':>16} {'other-ISA ms':>13} {'GB/s':>6} "
          f"{'plain->tiled ms':>16} {'GB/s':>6}")
    for spec in shapes:
        n, k = (int(v) for v in spec.split("x"))
        qw = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), "q4", 64).buffers()["qweight"]
        mb = qw.nbytes / 1e6
        generic = best_ms(lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            _unpack_q4(qw).to(torch.int32) + 8, 1), max(3, repeat // 3), False)
        here = best_ms(lambda: repack_for_kernel(qw), repeat, False)
        plain = best_ms(lambda: plain_to_tiled(qw.clone()), max(3, repeat // 3), False)
        print(f"{spec:>11} {mb:>7.1f} {here:>16.4f} {generic:>13.1f} {mb / generic:>6.2f} "
              f"{plain:>16.1f} {mb / plain:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--cpu-time", action="store_true", help="thread CPU time (use with --threads 1)")
    ap.add_argument("--repack", action="store_true", help="also time the q4 repack for these shapes")
    ap.add_argument("--columns", nargs="+", help="only these columns (q4 new, bf16 torch and q4 i8 always)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.native():
        raise SystemExit("the native kernels are unavailable here (see the notice above)")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads, stored q4 layout is torch's: {kernel_layout_is_stored_layout()}")
    n, k = (int(v) for v in args.shape.split("x"))
    kernel_table(n, k, args.rows, args.repeat, args.cpu_time, args.columns)
    if args.repack:
        repack_table([args.shape, "576x1536"], args.repeat)


if __name__ == "__main__":
    main()
