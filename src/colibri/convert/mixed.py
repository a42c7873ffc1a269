"""Mixed precision under a size budget: which q4 tensors are stored as q8, chosen from measured sensitivity.

Every candidate starts at q4 (group --group-size); promoting tensor t to q8 (per output channel) removes nearly
all of its measured sensitivity s_t (calibrate.py: the relative output error of its stage at q4; q8's error is
~1/16 of q4's step, so ~1/250 of its squared error) and costs its byte difference. Tensors are promoted in
order of s_t per extra byte while the container stays within the budget (a greedy knapsack).

The default budget is the size llama.cpp's Q4_K_M would give the same tensors (`q4_k_m_bytes`), so the container
is never larger than an equivalent Q4_K_M file.
"""

from __future__ import annotations

import re
from typing import Callable

from colibri.formats.container import part_layout
from colibri.core.errors import InputError

# llama.cpp's bits per weight of the block types its K-quant recipes use, and the fallbacks for rows not divisible
# by 256 (its llama_tensor_get_type: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0)
BITS = {"Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


RECIPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0")  # llama.cpp's file types that `colibri convert --quant` reproduces
_RECIPE_BASE = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K", "q8_0": "Q8_0"}


def llama_types(shapes: dict[str, tuple[int, ...]], num_layers: int, tied: bool, recipe: str) -> dict[str, str]:
    """The GGUF block type llama.cpp's quantizer gives each matrix under `recipe` (its llama_tensor_get_type for
    dense models): the head (for a tied model, its one table) Q6_K (Q8_0 under q8_0); under q4_k_m and q5_k_m,
    attn_v and ffn_down Q6_K in the `_more_bits` layers; every other matrix the recipe's own type. A row length not
    divisible by 256 falls back to Q5_0 / Q5_1 / Q8_0 as llama.cpp does (FALLBACK); one not divisible by 32 is left
    out (the base policy)."""
    base = _RECIPE_BASE[recipe]
    out = {}
    for name, shape in shapes.items():
        if len(shape) != 2:
            continue
        m = _LAYER.match(name)
        kind = base
        if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
            kind = "Q8_0" if base == "Q8_0" else "Q6_K"
        elif recipe in ("q4_k_m", "q5_k_m") and m and (".v_proj." in name or "down_proj." in name) \
                and _more_bits(int(m.group(1)), num_layers):
            kind = "Q6_K"
        if shape[-1] % 256 and kind in FALLBACK:
            kind = FALLBACK[kind]
        if shape[-1] % 32 == 0:
            out[name] = kind
    return out


def q4_k_m_bytes(shapes: dict[str, tuple[int, ...]], num_layers: int, tied: bool) -> int:
    """Bytes of these tensors under llama.cpp's Q4_K_M rules (`llama_types`); vectors f32."""
    types = llama_types(shapes, num_layers, tied, "q4_k_m")
    return sum(_numel(s) * 4 if len(s) == 1 else int(_numel(s) * BITS[types.get(n, "Q4_K")] / 8)
               for n, s in shapes.items())


def extent(kind: str, shape, group_size: int | None) -> int:
    """Bytes of a tensor of this kind (its parts; the container's 4096 alignment between tensors not counted,
    as a GGUF's 32-byte alignment is not counted in `q4_k_m_bytes`)."""
    parts = part_layout(kind, tuple(shape), group_size)
    return max(p.offset + p.nbytes for p in parts.values())


def choose(candidates: dict[str, tuple[tuple[int, ...], tuple[str, int]]], sensitivity: dict[str, float],
           fixed_bytes: int, budget: int, strict: bool) -> tuple[dict[str, tuple[str, int]], int]:
    """candidates: name -> (shape, its q4 (kind, group size)); fixed_bytes: every other tensor's bytes.
    Returns (name -> (kind, group size) for every candidate, the tensors' bytes). A budget below q4 alone is
    an error when `strict` (a budget the user gave), else it leaves everything at q4."""
    kinds = {n: q4 for n, (_, q4) in candidates.items()}
    total = fixed_bytes + sum(extent(q4[0], shape, q4[1]) for shape, q4 in candidates.values())
    if total > budget and strict:
        raise InputError(f"the size budget ({budget / 2**20:.1f} MiB) is below what q4 alone needs "
                         f"({total / 2**20:.1f} MiB); raise --bits-per-weight")
    gains = []
    for n, (shape, q4) in candidates.items():
        extra = extent("q8", shape, 0) - extent(q4[0], shape, q4[1])
        if sensitivity.get(n, 0) > 0 and extra > 0:
            gains.append((sensitivity[n] / extra, n, extra))
    for _, n, extra in sorted(gains, reverse=True):
        if total + extra <= budget:
            kinds[n] = ("q8", 0)
            total += extra
    return kinds, total


def q4_group(shape, group_size: int) -> int | None:
    """The q4 group size a matrix gets: --group-size, else the largest of 128/64/32 below it dividing K."""
    from colibri.quant import kinds as quant

    for g in (group_size, 128, 64, 32):
        if g <= group_size and quant.supports("q4", tuple(shape), g):
            return g
    return None


def calibrated_plan(ckpt, args, decoder, shapes: dict[str, tuple[int, ...]], tied: bool, opts, source_types: dict,
                    work, progress: Callable[[str, int, int], None] | None = None) -> tuple[dict[str, tuple[str, int]], object, dict]:
    """(kinds, calibrate.Calibration, policy record) for a calibrated q4 conversion. The calibration is kept in `work`
    (the conversion's partial directory) so that a resumed conversion does not measure again."""
    from colibri.convert import calibrate
    from colibri.formats import container
    from colibri.quant import kinds as quant

    tensors, _, _ = container.plan_layout(shapes, tied, "q4", opts.group_size, opts.page_size_mb << 20, source_types,
                                          requantize=opts.requantize)
    candidates, fixed, policy_kinds = {}, 0, {}
    for t in tensors:
        policy_kinds[t.name] = (t.kind, t.group_size)
        exact = source_types.get(t.name) in quant.GGUF_EXACT or t.kind in quant.GGUF_KEPT_KINDS
        g = q4_group(t.shape, opts.group_size) if len(t.shape) == 2 else None
        if t.kind in container.QUANT_KINDS and not exact and t.role != "router" and g is not None:
            candidates[t.name] = (tuple(t.shape), ("q4", g))
        else:
            fixed += t.nbytes
    if not candidates:
        return {}, None, {}
    path = work / calibrate.CALIBRATION
    cal = calibrate.Calibration.load(path)
    if cal is None:
        ids = calibrate.calibration_ids(getattr(ckpt, "tokenizer", None), args.vocab_size, opts.calibration_file,
                                        opts.calibration_tokens)
        cal = calibrate.calibrate(ckpt, args, decoder, ids, {n: q4 for n, (_, q4) in candidates.items()},
                                  progress=progress, measure=opts.mix == "measured")
        cal.save(path)
    params = sum(_numel(s) for s in shapes.values())
    budget = (int(opts.bits_per_weight * params / 8) if opts.bits_per_weight
              else q4_k_m_bytes(shapes, args.num_layers, tied))
    if opts.mix == "fixed":  # the fixed policy's kinds (v_proj, down_proj and the tables at q8), weighted fit
        kinds = {n: policy_kinds[n] for n in candidates}
        total = fixed + sum(extent(k, shape, g) for n, (shape, _) in candidates.items() for k, g in [kinds[n]])
    else:
        kinds, total = choose(candidates, cal.sensitivity, fixed, budget, strict=opts.bits_per_weight is not None)
    record = {"calibration": {"tokens": cal.tokens, "text": opts.calibration}, "mix": opts.mix,
              "budget_bytes": budget, "bits_per_weight": round(8 * total / params, 3),
              "q8": sorted(n for n, (k, _) in kinds.items() if k == "q8")}
    return kinds, cal, record


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
