"""Importance-weighted q4 fit: per group, the (scale, zero) minimizing sum_j a_j (w_j - w^_j)^2.

`a_j` is the importance of input channel j: the mean of x_j^2 over calibration activations (llama.cpp's imatrix),
so the weighted error is the expected squared error of the linear's output, E ||x (W - W^)^T||^2, per row under
a diagonal approximation. Channels that carry large activations get finer steps at the expense of quiet ones.

The search follows llama.cpp's make_qkx: candidate grids spanning the group's range with 15 +- 1 steps, each
followed by a weighted least-squares fit of (scale, zero) to its codes, then a few alternating refinements from
the best (re-round codes, refit). The unweighted fit (`quant._q4_fit`) is a candidate too, so the result is never
worse than it on the weighted error. Every error is measured with the bf16 values that will be stored.
"""

from __future__ import annotations

import torch

CANDIDATES = 5  # grids with 14.5, 14.75, ..., 15.5 steps across the group's range (a wider search buys little
REFINE_ITERS = 2  # error for its time: docs/quality.md, "Reading the table")
IMPORTANCE_FLOOR = 1e-3  # of a row of groups' mean importance: no channel is ignored outright


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def codes(wf: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest q in [0, 15] for w = (q - 8) * scale + zero (scale 0: q = 8)."""
    return torch.where(scale > 0, torch.round((wf - zero) / scale.clamp_min(1e-30)) + 8, 8).clamp_(0, 15)


def weighted_error(wf: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """sum_j a_j (w_j - w^_j)^2 per group, [R, G, 1], for stored (scale, zero) [R, G, 1] and nearest codes."""
    q = codes(wf, scale, zero)
    return (a * ((q - 8) * scale + zero - wf).square()).sum(-1, keepdim=True)


def _wls(wf: torch.Tensor, a: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted regression of w on x = q - 8: (scale, zero); groups without spread keep `scale`."""
    x = q - 8
    sw = a.sum(-1, keepdim=True).clamp_min(1e-30)
    xm, wm = (a * x).sum(-1, keepdim=True) / sw, (a * wf).sum(-1, keepdim=True) / sw
    dx = x - xm
    var = (a * dx.square()).sum(-1, keepdim=True) / sw
    cov = (a * dx * (wf - wm)).sum(-1, keepdim=True) / sw
    ok = (var > 0) & (cov > 0)
    s = torch.where(ok, cov / var.clamp_min(1e-30), scale)
    return s, wm - s * xm


def fit_q4_weighted(wf: torch.Tensor, importance: torch.Tensor, start: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) in bf16, [R, G] each. wf: f32 [R, G, g]; importance: [G, g] (>= 0, per input channel);
    start: the unweighted fit's bf16 (scale, zero) [R, G], kept where nothing beats it."""
    a = importance.float().unsqueeze(0)
    a = a + IMPORTANCE_FLOOR * a.mean().clamp_min(1e-30)
    lo, hi = wf.amin(-1, keepdim=True), wf.amax(-1, keepdim=True)
    rng = (hi - lo).clamp_min(1e-30)
    flat = hi == lo
    best_s, best_z = start[0].float().unsqueeze(-1), start[1].float().unsqueeze(-1)
    best = weighted_error(wf, a, best_s, best_z)

    def consider(s: torch.Tensor, z: torch.Tensor) -> None:
        nonlocal best, best_s, best_z
        s16, z16 = _bf16(torch.where(flat, 0, s)), _bf16(torch.where(flat, lo, z))
        err = weighted_error(wf, a, s16, z16)
        better = err < best
        best = torch.where(better, err, best)
        best_s, best_z = torch.where(better, s16, best_s), torch.where(better, z16, best_z)

    for i in range(CANDIDATES):
        steps = 14.5 + i / (CANDIDATES - 1)
        q = torch.round((wf - lo) * (steps / rng)).clamp_(0, 15)
        consider(*_wls(wf, a, q, rng / steps))
    s, z = best_s, best_z
    for _ in range(REFINE_ITERS):
        s, z = _wls(wf, a, codes(wf, s, z), s)
        consider(s, z)
        s, z = best_s, best_z
    return best_s.squeeze(-1).to(torch.bfloat16), best_z.squeeze(-1).to(torch.bfloat16)
