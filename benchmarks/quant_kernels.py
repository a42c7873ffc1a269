"""Time per `linear` call for dense and quantized weights, and the one-time q4 repack cost.

    python benchmarks/quant_kernels.py [--threads 2] [--repeat 15] [--shapes 4096x4096 576x1536]

Shapes are out x in (N x K). Each configuration cycles through enough copies of the weight to exceed the L3 cache
(so weights stream from RAM, as they do in the engine) and reports the best of --repeat timings, in ms.
Columns: f32 = f32 weights and x; bf16 = bf16 weights and x; q4/q8 = bf16 x (torch's int4/int8 kernels below
colibri.quant.BF16_GEMM_MIN_ROWS rows, dequantize + bf16 GEMM from there); "f32 x" = the exact f32 path.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from colibri.quant import _pack_q4, _unpack_q4, kernel_layout_is_stored_layout, quantize, repack_for_kernel

SHAPES = ["4096x4096", "11008x4096", "4096x11008", "576x1536"]
ROTATE_BYTES = 96 << 20  # > 32 MiB L3 of the target machines


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def time_linear(make, nbytes: int, x: torch.Tensor, repeat: int) -> float:
    """Best time of one `linear(x, w)` call, cycling over copies of w so the set does not fit in cache."""
    copies = [make() for _ in range(max(1, min(256, -(-ROTATE_BYTES // nbytes))))]
    i = 0

    def call():
        nonlocal i
        w = copies[i % len(copies)]
        i += 1
        return F.linear(x, w) if isinstance(w, torch.Tensor) else w.linear(x)

    # each timed call sees a different copy: time len(copies) calls, keep the best per-call average
    return best_ms(lambda: [call() for _ in copies], repeat) / len(copies)


def plain_to_tiled(p: torch.Tensor) -> torch.Tensor:
    """Row-major nibbles uint8 [N, K/2] (value 2i low, 2i + 1 high) -> the stored tiled layout."""
    return _pack_q4(torch.stack([p & 0x0F, p >> 4], dim=-1).view(p.shape[0], -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads, stored q4 layout is the kernel's: {kernel_layout_is_stored_layout()}")

    cols = ["f32", "bf16", "q4g32", "q4g64", "q4g128", "q8", "q8g32", "q4g32 f32x", "q8 f32x"]
    print(f"\nms per linear call (best of {args.repeat})")
    print(f"{'N x K':>11} {'T':>3} " + " ".join(f"{c:>10}" for c in cols))
    repack_rows = []
    for spec in args.shapes:
        n, k = (int(v) for v in spec.split("x"))
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        wb = w.bfloat16()
        quant = {"q4g32": quantize(w, "q4", 32), "q4g64": quantize(w, "q4", 64),
                 "q4g128": quantize(w, "q4", 128), "q8": quantize(w, "q8", 0), "q8g32": quantize(w, "q8", 32)}

        def clone_q(q):
            return lambda: type(q).from_buffers(q.shape, q.group_size, {k_: v.clone() for k_, v in q.buffers().items()})

        for t in (1, 64, 256):
            x = torch.randn(t, k)
            xb = x.bfloat16()
            row = {
                "f32": time_linear(w.clone, w.nbytes, x, args.repeat),
                "bf16": time_linear(wb.clone, wb.nbytes, xb, args.repeat),
                **{name: time_linear(clone_q(q), q.nbytes, xb, args.repeat) for name, q in quant.items()},
                "q4g32 f32x": time_linear(clone_q(quant["q4g32"]), quant["q4g32"].nbytes, x, args.repeat),
                "q8 f32x": time_linear(clone_q(quant["q8"]), quant["q8"].nbytes, x, args.repeat),
            }
            print(f"{spec:>11} {t:>3} " + " ".join(f"{row[c]:>10.3f}" for c in cols), flush=True)

        # Repack: what a non-AVX-512 machine pays at load (stored bytes -> its kernel layout via torch's packer;
        # on this machine that is a no-op, so time the same work explicitly), and what storing plain row-major
        # nibbles would cost on every machine (uint8 [N, K] -> tiled bytes).
        qw = quant["q4g64"].buffers()["qweight"]
        mb = qw.nbytes / 1e6
        generic = best_ms(lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            _unpack_q4(qw).to(torch.int32) + 8, 1), max(3, args.repeat // 3))
        here = best_ms(lambda: repack_for_kernel(qw), args.repeat)
        plain_bytes = qw.clone()  # stands in for row-major [N, K/2] bytes, two nibbles per byte along K
        plain = best_ms(lambda: plain_to_tiled(plain_bytes), max(3, args.repeat // 3))
        repack_rows.append((spec, mb, here, generic, plain))

    print("\nq4 repack at load (qweight bytes; GB/s = qweight bytes / time)")
    print(f"{'N x K':>11} {'MB':>7} {'this machine ms':>16} {'other-ISA ms':>13} {'GB/s':>6} "
          f"{'plain->tiled ms':>16} {'GB/s':>6}")
    for spec, mb, here, generic, plain in repack_rows:
        print(f"{spec:>11} {mb:>7.1f} {here:>16.4f} {generic:>13.1f} {mb / generic:>6.2f} "
              f"{plain:>16.1f} {mb / plain:>6.2f}")


if __name__ == "__main__":
    main()
