"""A dense decoder block as one native call (ops.DenseBlock, kernels/block.cpp), and every layer of the model as one
(ops.DenseLayers), give the bits of the calls DecoderModel.block makes one by one, on every native tier, for every
weight kind the containers hold, exact and LOSSY, in a prefill and in decode steps; and the ops refuse arguments
that do not describe blocks."""

import pytest
import torch

import colibri
import colibri.models.base as base
from colibri import kernels
from colibri.convert import pipeline as conv
from colibri.convert.pipeline import cached_container
from colibri.kernels import ops

NATIVE = [t for t in kernels.runnable_tiers() if t != "torch"]
IDS = [(7 * i + 3) % 384 for i in range(20)]


def _one_call_and_plain(monkeypatch, path, ids, **options):
    """(logits of a prefill, greedy tokens) with all layers as one call, then each block as one call, then the
    calls one by one; and the pass sizes of the one-call blocks that ran, per way."""
    calls = {"layers": [], "block": []}
    real_block, real_layers = ops.DenseBlock.__call__, ops.DenseLayers.__call__

    def block(self, x, *a):
        calls["block"].append(x.shape[0])
        return real_block(self, x, *a)

    def layers(self, x, ropes, *a):
        calls["layers"] += [x.shape[0]] * len(ropes)
        return real_layers(self, x, ropes, *a)

    out = []
    with monkeypatch.context() as mp:
        mp.setattr(ops.DenseBlock, "__call__", block)
        mp.setattr(ops.DenseLayers, "__call__", layers)
        for way in ("layers", "block", "plain"):
            if way == "block":
                mp.setattr(base.DecoderModel, "_blocks_call", lambda self, *a: None)
            if way == "plain":
                mp.setattr(base.DecoderModel, "_block_call", lambda self, *a: None)
            with colibri.load(path, **options) as m:
                out.append((m.logits(ids), m.generate(ids, max_tokens=6, temperature=0).token_ids))
    return out, calls


def _check(monkeypatch, path, ids, layers, **options):
    for tier in NATIVE:
        kernels.use(tier)
        try:
            (*ways, (want_logits, want_tokens)), calls = _one_call_and_plain(monkeypatch, path, ids, **options)
        finally:
            kernels.use(None)
        for way, (logits, tokens) in zip(("all layers", "each block"), ways):
            assert torch.equal(logits, want_logits), f"{tier} {options}: the logits of {way} as one call differ"
            assert tokens == want_tokens, f"{tier} {options}: {way} as one call"
        # every layer of the prefill and of the generation's prompt pass, and of its decode steps (one token, or a
        # few where n-gram drafts are verified), each way
        for way, sizes in calls.items():
            assert sizes.count(len(ids)) == 2 * layers and len(sizes) % layers == 0, (tier, way, sizes)
            assert sizes.count(1) >= layers and all(t == len(ids) or t <= 8 for t in sizes), (tier, way, sizes)


@pytest.mark.parametrize("fam,dtype", [("llama", "bfloat16"), ("mistral", "float32"), ("qwen2", "bfloat16")])
def test_dense_families_one_call_is_the_calls_bits(tiny_model_dir, monkeypatch, fam, dtype):
    """Dense weights (dense_linear); mistral's sliding window, qwen2's q / k / v biases."""
    _check(monkeypatch, tiny_model_dir(fam), IDS, 2, dtype=dtype)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_quantized_one_call_is_the_calls_bits_exact_and_lossy(tiny_model_dir, tmp_path, monkeypatch, kind):
    path = cached_container(tiny_model_dir("qwen2"), tmp_path, kind)
    for lossy in (False, True):
        _check(monkeypatch, path, IDS, 2, lossy_int8_activations=lossy)


def test_k_quants_one_call_is_the_calls_bits_exact_and_lossy(tmp_path, monkeypatch):
    """The GGUF kinds kept at their own size (q4k, q6k, q5_0, q5k, iq4_xs, q3k, iq4_nl, q2k, q5_1: test_kquant's
    two-layer llama), f32 and bf16 activations, exact and LOSSY."""
    from test_kquant import k_gguf

    out = tmp_path / "c"
    conv.convert(k_gguf(tmp_path / "k.gguf"), out, conv.ConvertOptions(quant="q4", page_size_mb=1))
    ids = list(range(0, 2048, 97))
    for dtype, lossy in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
        _check(monkeypatch, out, ids, 2, dtype=dtype, lossy_int8_activations=lossy)


def test_dense_block_and_layers_refuse_what_is_not_blocks():
    if not NATIVE:
        pytest.skip("no native tier")
    kernels.use(NATIVE[-1])
    try:
        lib = kernels.library()
        x = torch.zeros(1, 64)
        w = torch.zeros(64, 64)
        block = [torch.zeros(1, 16, 16)]
        args = dict(norms=[torch.ones(64)] * 2, cos=torch.ones(1, 16), sin=torch.zeros(1, 16), kb=block, vb=block,
                    length=1, positions=torch.zeros(1, dtype=torch.int64), window=0, scale=0.25, softcap=0.0,
                    eps=1e-6, piece=16384, bias=[])
        dense = kernels.OPS.index("dense_linear")

        def call(ops_, weights, counts):
            return lib.dense_block(x, args["norms"], ops_, weights, counts, [0] * len(ops_), [64] * len(ops_),
                                   args["bias"], args["cos"], args["sin"], block, block, 1, args["positions"], 0,
                                   0.25, 0.0, 1e-6, 16384)

        with pytest.raises(RuntimeError, match="seven linears"):
            call([dense] * 6, [w] * 6, [1] * 6)
        with pytest.raises(RuntimeError, match="add up"):
            call([dense] * 7, [w] * 6, [1] * 7)
        with pytest.raises(RuntimeError, match="not a linear op"):
            call([kernels.OPS.index("rms_norm")] + [dense] * 6, [w] * 7, [1] * 7)
        with pytest.raises(RuntimeError, match="tensors, its op takes"):
            call([dense] * 7, [w] * 9, [2] + [1] * 5 + [2])

        kv = torch.zeros(16, 64)  # k and v: one KV head of 16, as the blocks hold

        def layers(n, weights, kb, kv_counts, windows):  # n layers of dense weights
            return lib.dense_blocks(x, args["norms"] * n, [dense] * 7 * n, weights, [1] * 7 * n, [0] * 7 * n,
                                    [64, 16, 16, 64, 64, 64, 64] * n, [], [args["cos"]] * n, [args["sin"]] * n, kb,
                                    kb, kv_counts, [1] * n, args["positions"], windows, 0.25, 0.0, 1e-6, 16384)

        two = [w, kv, kv, w, w, w, w] * 2
        assert layers(2, two, block * 2, [1, 1], [0, 0]).shape == (1, 64)
        with pytest.raises(RuntimeError, match="per layer two norms"):
            layers(2, two, block * 2, [1, 1], [0, 0, 0])
        with pytest.raises(RuntimeError, match="run past their lists"):
            layers(2, two, block * 2, [1, 2], [0, 0])
        with pytest.raises(RuntimeError, match="add up to the weights and KV blocks"):
            layers(2, two + [w], block * 2, [1, 1], [0, 0])
    finally:
        kernels.use(None)


def test_a_layers_block_is_made_once_where_the_store_keeps_its_weights(tiny_model_dir, tmp_path, monkeypatch):
    """All in RAM each layer's DenseBlock is made once and used by every pass (a decode step does no work per weight
    in Python); a streaming store makes one per layer and pass (a kept block would hold its pages), and a weight a
    RAM store's tensors replace makes a new one, used from the next pass on."""
    if not NATIVE:
        pytest.skip("no native tier")
    from test_streaming import limit_for

    path = cached_container(tiny_model_dir("qwen2"), tmp_path, "q4")
    made = []
    real = base.DecoderModel._dense_block
    monkeypatch.setattr(base.DecoderModel, "_dense_block", lambda self, *a: made.append(1) or real(self, *a))
    with colibri.load(path) as m:
        tokens = m.generate(IDS, max_tokens=6, temperature=0).token_ids
        assert len(made) == 2, made  # two layers, one pass of the prompt and five decode steps
        name = m.decoder.block_names[1][2][6]  # layer 1's down weight, replaced by a copy of layer 0's
        m.store.tensors[name] = m.store.get(m.decoder.block_names[0][2][6])
        assert m.generate(IDS, max_tokens=6, temperature=0).token_ids != tokens
        assert len(made) == 3
    made.clear()
    with colibri.load(path, memory_limit=limit_for(path, 0.0)) as m:
        assert m.store.placement.streamed
        assert m.generate(IDS, max_tokens=6, temperature=0).token_ids == tokens
        assert len(made) == 2 * 6, made
