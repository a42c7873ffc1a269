"""The warm-up before the runtime baseline is measured: each kind of kernel once on tiny inputs and, under a
memory limit, a pass of a miniature of the model, so that one-time state torch creates on first use counts in the
baseline, outside the budget."""

from __future__ import annotations

import torch


def warm_up(dtype: torch.dtype, decoder=None) -> "tuple[torch.Tensor, list[int]] | None":
    """Run each kind of kernel once on tiny inputs, so the one-time state torch creates on first use (thread
    pools, kernel caches, the pages of library code each kernel lives in) is part of the measured baseline
    rather than charged to the budget. `decoder` given (the model's math): one prefill and one two-sequence decode
    pass of a miniature of it (a layer of each kind, 64 wide, random weights), which pages in the code the real
    passes run (libtorch code that the kernels below alone leave out; its size is in docs/performance.md,
    section "Streaming under `--memory-limit`"); returns that pass's
    logits [2, V] and the ids before them, for the caller to warm the sampler on (`sampling.warm_up`)."""
    import torch.nn.functional as F

    x = torch.ones(2, 64, dtype=dtype)
    F.linear(x, torch.ones(64, 64, dtype=dtype))
    from colibri.models.base import attend
    q = torch.ones(2, 2, 16, dtype=dtype)
    attend(q, q, q, torch.arange(2), None, 0.25, None)
    torch.softmax(x.float(), dim=-1)
    if decoder is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the same kernels' code, without waiting on the wake-ups of worker threads,
        try:  # which a busy machine delays (docs/performance.md, "Streaming under `--memory-limit`")
            return _warm_forward(decoder, dtype)
        finally:
            torch.set_num_threads(threads)
    return None


def miniature(args):
    """`args` shrunk to a model of a few small layers with the same features: one layer of each (attention
    kind, MoE or dense) the model has, 64 wide, its grouped-query ratio, at most 4 experts."""
    import dataclasses

    kinds = list(dict.fromkeys(zip(args.layer_types, args.moe_layers)))
    experts = min(args.num_experts, 4)
    group = max(1, min(4, args.num_heads // max(1, args.num_kv_heads)))
    return dataclasses.replace(
        args, vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=len(kinds), num_heads=2 * group,
        num_kv_heads=2, head_dim=16, layer_types=[t for t, _ in kinds], moe_layers=[m for _, m in kinds],
        num_experts=experts, top_k=min(args.top_k, experts),
        moe_intermediate_size=32 if args.moe_intermediate_size else 0,
        shared_expert_intermediate_size=32 if args.shared_expert_intermediate_size else 0,
        sliding_window=None if args.sliding_window is None else 8, eos_token_id=[])


@torch.inference_mode()
def _warm_forward(decoder, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    from colibri.kv.cache import KVCache, KVLayout
    from colibri.models.base import SLIDING, Batch
    from colibri.weights.store import RamStore

    mini = type(decoder)(miniature(decoder.args))
    a, g = mini.args, torch.Generator().manual_seed(0)
    store = RamStore({name: (torch.randn(shape, generator=g) * 0.02 + (1.0 if len(shape) == 1 else 0.0)).to(dtype)
                      for name, shape in mini.weight_shapes().items()}, dtype)
    layout = KVLayout(a.num_layers, a.num_kv_heads, a.head_dim, dtype, block=8)
    windows = [a.sliding_window if t == SLIDING else None for t in a.layer_types]
    caches = [KVCache(layout, 32, layer_windows=windows) for _ in range(2)]
    ids = list(range(12))
    for c in caches:
        c.reserve(len(ids))
    mini.forward(store, Batch.pack([(ids, 0, c, len(ids) - 1) for c in caches]))
    for c in caches:
        c.advance(len(ids), ids)
        c.reserve(1)
    return mini.forward(store, Batch.pack([([1], c.length, c, 0) for c in caches])).float(), ids
