"""GGUF K-quants kept exactly (colibri.quant.kinds): Q4_K -> q4k, Q6_K -> q6k (and q8k, its codes widened, which
older containers hold), bit for bit; their kernels; a K-quant
GGUF converted by default into a container with one tied table."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

import colibri
import colibri.runtime.model
from colibri.convert import pipeline as conv
from colibri import kernels
from colibri.weights import placement
from colibri.formats.container import ContainerCheckpoint
from colibri.quant.kinds import GGUF_KEPT_KINDS, from_gguf
from synthetic_gguf import llama_writer

BLOCK = {QT.Q4_K: 144, QT.Q6_K: 210, QT.Q3_K: 110, QT.IQ4_XS: 136, QT.IQ4_NL: 18, QT.Q5_K: 176, QT.Q2_K: 84,
         QT.Q5_1: 24, QT.Q5_0: 22}  # bytes a block
VALUES = {QT.IQ4_NL: 32, QT.Q5_1: 32, QT.Q5_0: 32}  # values per block (the others: 256)


def k_blocks(qtype, n: int, k: int, seed: int, scale: float = 1e-3) -> np.ndarray:
    """Valid random blocks [n, k / block values * block bytes]: random codes and scales, sane positive f16
    super-scales (Q4_K, Q5_K: d, dmin first; the IQ4 kinds, Q5_0: d first; Q6_K, Q3_K: d last; Q2_K: d, dmin last;
    Q5_1: d and a negative m, about a block's minimum, first)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // VALUES.get(qtype, 256), BLOCK[qtype]), dtype=np.uint8)
    two = qtype in (QT.Q4_K, QT.Q5_K, QT.Q2_K, QT.Q5_1)
    d = rng.uniform(0.2, 1.0, raw.shape[:2] + (2 if two else 1,)).astype(np.float16) * np.float16(scale)
    if qtype == QT.Q5_1:
        d[..., 1] *= np.float16(-16)
    if qtype in (QT.Q4_K, QT.Q5_K, QT.IQ4_XS, QT.IQ4_NL, QT.Q5_1, QT.Q5_0):
        raw[..., 0:2 * d.shape[-1]] = d.view(np.uint8)
    else:
        raw[..., BLOCK[qtype] - 2 * d.shape[-1]:] = d.view(np.uint8)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qtype, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(n, k))


def _k_weight(raw, qtype, kind: str, n: int, k: int):
    w = from_gguf(raw, qtype, (n, k))
    return w.as_q8k() if kind == "q8k" else w


KINDS = [(QT.Q4_K, "q4k"), (QT.Q6_K, "q6k"), (QT.Q6_K, "q8k"), (QT.Q3_K, "q3k"), (QT.IQ4_XS, "iq4_xs"),
         (QT.IQ4_NL, "iq4_nl"), (QT.Q5_K, "q5k"), (QT.Q2_K, "q2k"), (QT.Q5_1, "q5_1")]


@pytest.mark.parametrize("qtype,kind", KINDS)
def test_k_quants_dequantize_bit_exactly(qtype, kind):
    n, k = 80, 512  # 80 rows: a full 64-row tile and a 16-row tail tile for q4k
    raw = k_blocks(qtype, n, k, seed=1)
    w = _k_weight(raw, qtype, kind, n, k)
    assert w.kind.name == kind
    ref = reference(raw, qtype, n, k)
    assert torch.equal(w.dequantize(), ref)
    ids = torch.tensor([0, 63, 64, 79, 5, 0])  # tile edges, the tail tile, a repeat
    assert torch.equal(w.rows(ids), ref[ids])
    # bytes: the codes, the scale (and min) codes (q4k: 12 bits a (sc, m) pair, as Q4_K), f16 super-scales
    per_super = {"q4k": 128 + 12 + 4, "q6k": 210, "q8k": 256 + 16 + 2, "q3k": 110, "iq4_xs": 136,
                 "iq4_nl": 8 * 18, "q5k": 176, "q2k": 84, "q5_1": 8 * 24}[kind]  # the kinds as blocks: the file's
    assert w.nbytes == n * k // 256 * per_super
    # a reader's views over the stored buffers give the same weight
    again = type(w).from_buffers(w.shape, w.group_size, w.buffers())
    assert torch.equal(again.dequantize(), ref)


@pytest.fixture(params=["native", "torch"])
def mode(request):
    """native: the best tier this machine builds (auto, the torch kernels where none does); torch: the
    fallback. The process's own setting after."""
    kernels.use("auto" if request.param == "native" else "torch")
    yield request.param
    kernels.use(None)


@pytest.mark.parametrize("qtype,kind", KINDS)
def test_k_quant_linear_matches_f32_math_and_is_batch_invariant(qtype, kind, mode):
    n, k = 80, 512
    raw = k_blocks(qtype, n, k, seed=2)
    w = _k_weight(raw, qtype, kind, n, k)
    ref_w = reference(raw, qtype, n, k).double()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        xd = x.to(dtype)
        y16 = w.linear(xd)
        want = xd.double() @ ref_w.T
        assert ((y16.double() - want).abs().max() / want.abs().max()).item() < tol
        for t in (1, 3):  # each row's result is independent of the rows beside it
            assert torch.equal(w.linear(xd[:t]), y16[:t])
        assert torch.equal(w.linear(xd[5:8]), y16[5:8])


@pytest.mark.parametrize("kind", ["q6k", "q8k", "q3k"])
def test_q6_k_decode_rows_match_the_buffered_path(kind, mode):
    """Up to 6 rows dequantize in registers, more through a buffer: the same values either way, and q6k's and
    q3k's equal q8k's. K = 2304 walks the dot form's 1024-column chunks and a short last one; 37 rows end in a part block."""
    n, k = 37, 2304
    qtype = QT.Q3_K if kind == "q3k" else QT.Q6_K
    raw = k_blocks(qtype, n, k, seed=4)
    w = _k_weight(raw, qtype, kind, n, k)
    q8 = w.as_q8k() if kind != "q8k" else w
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    for dtype in (torch.float32, torch.bfloat16):
        y16 = w.linear(x.to(dtype))
        assert torch.equal(y16, q8.linear(x.to(dtype)))
        for lo, hi in ((0, 1), (2, 4), (3, 9), (10, 16), (4, 10)):
            assert torch.equal(w.linear(x[lo:hi].to(dtype)), y16[lo:hi])


def test_q5_0_is_kept_exactly_with_q8_bits(mode):
    """Q5_0 blocks as stored: dequantize equals gguf's, rows too, at the source's bytes; linear gives the bits of its
    codes widened to q8 (group 32, f16 scales), batch-invariant; in the LOSSY int8 mode it stays exact."""
    n, k = 45, 896
    raw = gguf_quantize(np.random.default_rng(6).standard_normal((n, k), dtype=np.float32), QT.Q5_0)
    w = from_gguf(raw, QT.Q5_0, (n, k))
    ref = reference(raw, QT.Q5_0, n, k)
    assert w.kind.name == "q5_0" and w.nbytes == raw.nbytes
    assert torch.equal(w.dequantize(), ref) and torch.equal(w.rows(torch.tensor([44, 0, 7])), ref[[44, 0, 7]])
    q8 = w.as_q8()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(8))
    exact = {dtype: q8.linear(x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    for int8 in (False, True):
        kernels.set_int8_activations(int8 and mode == "native")
        try:
            for dtype in (torch.float32, torch.bfloat16):
                y16 = w.linear(x.to(dtype))
                assert torch.equal(y16, exact[dtype])
                for lo, hi in ((0, 1), (2, 5), (3, 16)):
                    assert torch.equal(w.linear(x[lo:hi].to(dtype)), y16[lo:hi])
        finally:
            kernels.set_int8_activations(None)


def test_other_k_quants_are_not_imported():
    with pytest.raises(ValueError, match="not supported"):
        from_gguf(np.zeros((4, 66), np.uint8), QT.IQ2_XXS, (4, 256))


def k_gguf(path, embedding_as_head: bool = False, one_table=None):
    """A two-layer llama GGUF (D 256, FFN 512, vocab 2048: the table is the largest page) with Q4_K and Q6_K
    matrices (and one of each other kind kept exactly: in layer 0 Q5_0 attn_k, as Qwen2.5's K = 896 matrices are;
    Q5_K attn_v, IQ4_XS attn_output, Q3_K ffn_gate, IQ4_NL ffn_up; layer 1 its kinds but Q2_K attn_q and Q5_1
    attn_k) as llama.cpp's Q4_K_M writes them, and a tied table stored twice: output.weight Q6_K, token_embd the
    same matrix as Q4_0 (or, with `embedding_as_head`, output.weight's own blocks: the model a one-table
    container computes). `one_table`: the file stores one table of that GGUF type (no output.weight: tied)."""
    d, f, v, heads, kv = 256, 512, 2048, 4, 2
    w = llama_writer(path, 2, d, f, heads, kv)
    out = k_blocks(QT.Q6_K, v, d, seed=10, scale=2e-3)
    table = np.ascontiguousarray(gguf_dequantize(out, QT.Q6_K), dtype=np.float32).reshape(v, d)
    if one_table is not None:
        w.add_tensor("token_embd.weight", k_blocks(one_table, v, d, seed=11, scale=2e-3), raw_dtype=one_table)
    elif embedding_as_head:
        w.add_tensor("token_embd.weight", out, raw_dtype=QT.Q6_K)
    else:
        w.add_tensor("token_embd.weight", gguf_quantize(table, QT.Q4_0), raw_dtype=QT.Q4_0)
    if one_table is None:
        w.add_tensor("output.weight", out, raw_dtype=QT.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    mats = {"attn_q": (d, d, QT.Q4_K), "attn_k": (d // heads * kv, d, QT.Q5_0), "attn_v": (d // heads * kv, d, QT.Q5_K),
            "attn_output": (d, d, QT.IQ4_XS), "ffn_gate": (f, d, QT.Q3_K), "ffn_up": (f, d, QT.IQ4_NL),
            "ffn_down": (d, f, QT.Q6_K)}
    for layer in (0, 1):
        for i, (name, (n, k, qtype)) in enumerate(mats.items()):
            qtype = {"attn_q": QT.Q2_K, "attn_k": QT.Q5_1}.get(name, qtype) if layer else qtype
            seed = 20 + 10 * layer + i
            data = (gguf_quantize(np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.03, qtype)
                    if qtype == QT.Q5_0 else k_blocks(qtype, n, k, seed=seed, scale=1e-3))
            w.add_tensor(f"blk.{layer}.{name}.weight", data, raw_dtype=qtype)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{name}.weight", np.ones(d, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def k_container(tmp_path_factory):
    root = tmp_path_factory.mktemp("kquant")
    src = k_gguf(root / "k.gguf")
    conv.convert(src, root / "c", conv.ConvertOptions(quant="q4", page_size_mb=1))
    return src, root / "c", k_gguf(root / "one-table.gguf", embedding_as_head=True)


def test_k_quant_gguf_converts_exactly_with_one_table(k_container):
    from colibri.formats.gguf import GGUFCheckpoint

    src, out, _ = k_container
    m = json.loads((out / "manifest.json").read_text())
    assert m["version"] == 5  # q4k's tile-major scale codes and supers (and 3's required checksums)
    kinds = {t["name"]: t["kind"] for t in m["tensors"]}
    assert "lm_head.weight" not in kinds and kinds["model.embed_tokens.weight"] == "q6k"  # output.weight's Q6_K
    assert kinds["model.layers.0.mlp.down_proj.weight"] == "q6k"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "q4k"
    assert kinds["model.layers.0.self_attn.k_proj.weight"] == "q5_0"
    assert kinds["model.layers.0.self_attn.v_proj.weight"] == "q5k"
    assert [kinds[f"model.layers.0.{n}.weight"] for n in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")] == [
        "iq4_xs", "q3k", "iq4_nl"]
    assert [kinds[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qk"] == ["q2k", "q5_1"]
    c, g = ContainerCheckpoint(out), GGUFCheckpoint(src)
    for name, kind in kinds.items():
        if kind in GGUF_KEPT_KINDS:
            source = "lm_head.weight" if name == "model.embed_tokens.weight" else name
            assert torch.equal(c.load(name).dequantize(), g.load(source)), name
    container_bytes = sum(f["size"] for f in m["files"])
    assert container_bytes < sum(int(t.n_bytes) for t in g._reader.tensors) + 64 * 4096  # table once; alignment


@pytest.mark.parametrize("version", [3, 4])
def test_a_container_made_before_q4k_tiled_its_codes_reads_the_same(tmp_path, monkeypatch, version):
    """Containers of format version 4 hold q4k's packed codes and supers group-major ([K/32, Np/16, 24], [K/256,
    Np, 2]); those of version 3 the (sc, m) codes a byte each ([K/32, Np, 2]): written here as the converter wrote
    them then, they read (no repack) and give the version-5 container's logits bit for bit, the table read by tiles
    from disk included."""
    from colibri.formats import container as cont
    from colibri.quant import kinds

    src = k_gguf(tmp_path / "t.gguf", one_table=QT.Q4_K)
    new = tmp_path / "new"
    conv.convert(src, new, conv.ConvertOptions(quant="q4", page_size_mb=1))
    assert json.loads((new / "manifest.json").read_text())["version"] == 5
    with monkeypatch.context() as mp:  # the writer before version 5
        legacy = kinds._k_buffer_layout

        def old_layout(kind, n, k):
            layout = legacy(kind, n, k)
            if kind.name == "q4k":
                scales, supers = kinds.q4k_legacy_layouts((n, k))[4 - version]
                layout["scales"], layout["supers"] = (torch.uint8, scales), (torch.float16, supers)
            return layout

        mp.setattr(kinds, "_k_buffer_layout", old_layout)
        mp.setattr(kinds, "q4k_tiled", lambda scales, supers: (scales, supers))
        if version == 3:
            mp.setattr(kinds, "q4k_pack_codes", lambda sc, m: torch.stack([sc, m], dim=-1).contiguous())
        mp.setattr(cont, "version_for", lambda kinds: version)
        conv.convert(src, tmp_path / "old", conv.ConvertOptions(quant="q4", page_size_mb=1))
    old = tmp_path / "old"
    m = json.loads((old / "manifest.json").read_text())
    q = next(t for t in m["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert m["version"] == version and q["kind"] == "q4k"
    assert q["parts"]["scales"]["shape"][-1] == (2 if version == 3 else 24) and len(q["parts"]["supers"]["shape"]) == 3
    name = "model.layers.0.self_attn.q_proj.weight"
    old_w, new_w = ContainerCheckpoint(old).load(name), ContainerCheckpoint(new).load(name)
    assert torch.equal(old_w.dequantize(), new_w.dequantize())
    ids = list(range(0, 2048, 37))
    want = colibri.load(new, dtype="float32").logits(ids)
    assert torch.equal(colibri.load(old, dtype="float32").logits(ids), want)
    assert torch.equal(colibri.load(old, dtype="bfloat16").logits(ids), colibri.load(new, dtype="bfloat16").logits(ids))
    monkeypatch.setattr(placement, "BLOCK_BYTES", 4096)  # the table by tiles and row blocks from disk
    monkeypatch.setattr(placement, "HEAD_BUFFERS", 1)
    for path in (old, new):
        minimum = colibri.runtime.model.plan(path, None, dtype=torch.float32, batch_size=1)[0].minimum
        streamed = colibri.load(path, dtype="float32", memory_limit=minimum, prefetch_depth=0, batch_size=1)
        assert torch.equal(streamed.logits(ids), want), path.name
        assert streamed.store.stats.row_bytes_read > 0


def test_every_kind_is_kept_without_a_notice(tmp_path, capsys):
    """Q5_K, Q2_K and Q5_1 have exact kinds (q5k, q2k, q5_1): converting a GGUF that holds them (and the other
    kinds kept) re-quantizes nothing, so no notice names one."""
    src = k_gguf(tmp_path / "k.gguf")
    capsys.readouterr()
    conv.convert(src, tmp_path / "c", conv.ConvertOptions(quant="q4", page_size_mb=1))
    err = capsys.readouterr().err
    assert "no exact kind" not in err and "Q5_K" not in err and "Q2_K" not in err and "Q5_1" not in err, err
    t = ContainerCheckpoint(tmp_path / "c").tensors
    assert [t[f"model.layers.{n}.weight"].kind for n in ("0.self_attn.v_proj", "1.self_attn.q_proj",
                                                        "1.self_attn.k_proj")] == ["q5k", "q2k", "q5_1"]


def test_k_quant_container_logits_and_streamed_table(k_container, monkeypatch):
    """The one table serves the lookup and the head: resident, and read by rows / row blocks from disk, the
    logits are those of the GGUF whose embedding is output.weight's blocks (the table kept)."""
    src, out, one_table = k_container
    ids = list(range(0, 2048, 37))
    want = colibri.load(one_table, dtype="float32").logits(ids)
    got = colibri.load(out, dtype="float32").logits(ids)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    monkeypatch.setattr(placement, "BLOCK_BYTES", 4096)  # several head blocks...
    monkeypatch.setattr(placement, "HEAD_BUFFERS", 1)  # ...through buffers smaller than the table
    path = out
    minimum = colibri.runtime.model.plan(path, None, dtype=torch.float32, batch_size=1)[0].minimum
    m = colibri.load(path, dtype="float32", memory_limit=minimum, prefetch_depth=0, batch_size=1)
    assert {m.checkpoint.pages[i].kind for i in m.store.placement.by_rows} == {"embedding"}
    assert torch.equal(m.logits(ids), got)
    assert m.store.stats.row_bytes_read > 0
    old = conv.ConvertOptions(quant="q4", page_size_mb=1, requantize=True)  # the old policy: lossy, q4 / q8
    conv.convert(src, out.with_name("old"), old)
    old_kinds = {t["kind"] for t in json.loads((out.with_name("old") / "manifest.json").read_text())["tensors"]}
    assert old_kinds == {"q4", "q8", "f32"}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ContainerCheckpoint(out.with_name("old")).load(q).dequantize(),
                           ContainerCheckpoint(out).load(q).dequantize())


def test_block_kinds_rows_are_the_same_natively(k_container, monkeypatch):
    """Rows of a table of 256-value blocks (a K-quant model's token embedding) decoded by the native `kquant_rows`
    on every native tier are the torch path's bits; a row outside the table is refused."""
    tiers = [t for t in kernels.runnable_tiers() if t != "torch"]
    if not tiers:
        pytest.skip("no native tier")
    c = ContainerCheckpoint(k_container[1])
    kinds = {"q6k", "q3k", "iq4_xs", "q5k", "q2k"}
    weights = {e.kind: c.load(name) for name, e in c.tensors.items() if e.kind in kinds}
    assert set(weights) == kinds
    for kind, w in weights.items():
        ids = torch.tensor([0, w.shape[0] - 1, 5, 0, w.shape[0] // 2])
        with monkeypatch.context() as mp:
            mp.setattr(kernels, "native", lambda: False)
            want = w.rows(ids)
        for tier in tiers:
            kernels.use(tier)
            try:
                assert torch.equal(w.rows(ids), want), (kind, tier)
                with pytest.raises(RuntimeError, match="is not in the table"):
                    w.rows(torch.tensor([w.shape[0]]))
            finally:
                kernels.use(None)


@pytest.mark.parametrize("tier", [None, "torch"])
@pytest.mark.parametrize("qtype,kind", [(QT.Q4_K, "q4k"), (QT.Q2_K, "q2k"), (QT.Q5_1, "q5_1")])
def test_one_table_is_read_by_rows(tmp_path, monkeypatch, qtype, kind, tier):
    """A tied table kept exactly (q4k: the lookup reads 64-row tiles, the head streams whole tiles in row blocks;
    q2k, q5_1: rows of blocks): the logits read that way equal the resident container's and, within the kernels'
    tolerance, the GGUF's. On the torch fallback too, whose GEMMs over a block's few rows gave q5_1 other bits
    (kernels.padded_linear)."""
    kernels.use(tier)
    try:
        _read_by_rows(tmp_path, monkeypatch, qtype, kind)
    finally:
        kernels.use(None)


def _read_by_rows(tmp_path, monkeypatch, qtype, kind):
    src = k_gguf(tmp_path / "t.gguf", one_table=qtype)
    out = tmp_path / "c"
    conv.convert(src, out, conv.ConvertOptions(quant="q4", page_size_mb=1))
    assert ContainerCheckpoint(out).tensors["model.embed_tokens.weight"].kind == kind
    ids = list(range(0, 2048, 37))
    got = colibri.load(out, dtype="float32").logits(ids)
    want = colibri.load(src, dtype="float32").logits(ids)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    monkeypatch.setattr(placement, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(placement, "HEAD_BUFFERS", 1)
    minimum = colibri.runtime.model.plan(out, None, dtype=torch.float32, batch_size=1)[0].minimum
    m = colibri.load(out, dtype="float32", memory_limit=minimum, prefetch_depth=0, batch_size=1)
    assert {m.checkpoint.pages[i].kind for i in m.store.placement.by_rows} == {"embedding"}
    assert torch.equal(m.logits(ids), got)
