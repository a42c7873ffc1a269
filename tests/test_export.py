"""`colibri convert --input CONTAINER --output model.gguf` (colibri.convert.export): every kind kept from a GGUF goes
back to the GGUF's own blocks, so import -> export -> import is byte-identical in the tensors and the exported file
holds the source's tensors, types, shapes and metadata; a kind no GGUF type holds is re-quantized with a notice; bad
input gets one line and leaves no file behind."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from colibri import cli
from colibri.convert import export
from colibri.convert.pipeline import ConvertOptions, convert
from colibri.formats import container
from colibri.formats.container import ContainerCheckpoint
from colibri.quant import kinds as quant
from test_kquant import k_blocks

D, FFN, HEADS, KV, LAYERS = 256, 512, 4, 2, 1  # K = 256 or 512: whole super-blocks for the K-quants
BYTE_TOKENS = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)] \
    + [chr(256 + c) for c in range(68)]  # the GPT-2 byte alphabet (256 pieces)
TOKENS = BYTE_TOKENS + ["Ġt", "<|endoftext|>"]
EXACT = [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.Q3_K, QT.IQ4_XS, QT.IQ4_NL, QT.Q5_K, QT.Q2_K,
         QT.Q5_1]


def _matrix(qtype, n: int, k: int, seed: int) -> np.ndarray:
    if qtype == QT.F16:
        return (np.random.default_rng(seed).standard_normal((n, k)) * 0.02).astype(np.float16)
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q5_1):  # gguf's own quantizers
        return gguf_quantize((np.random.default_rng(seed).standard_normal((n, k)) * 0.02).astype(np.float32), qtype)
    return k_blocks(qtype, n, k, seed)


def tiny_gguf(path, qtype, arch: str = "llama", experts: int = 0, tiny_embd: bool = False):
    """A one-layer model with a byte-level tokenizer and a chat template, every matrix of `qtype` (untied: token_embd
    and output differ); qwen2 and qwen2moe: q/k/v biases; `experts`: fused expert tensors (llama: Mixtral;
    qwen2moe: with a shared expert); `tiny_embd` (F16): token_embd's values near f16's smallest."""
    w = GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(2)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
    if arch == "qwen2moe":
        w.add_expert_feed_forward_length(FFN)
        w.add_expert_shared_feed_forward_length(FFN)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - 1) + [3])
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(len(TOKENS) - 1)
    w.add_eos_token_id(len(TOKENS) - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    kvd = D // HEADS * KV
    mats = {"token_embd": (len(TOKENS), D), "output": (len(TOKENS), D), "blk.0.attn_q": (D, D),
            "blk.0.attn_k": (kvd, D), "blk.0.attn_v": (kvd, D), "blk.0.attn_output": (D, D)}
    ffn = {"ffn_gate": (FFN, D), "ffn_up": (FFN, D), "ffn_down": (D, FFN)}
    mats |= {f"blk.0.{n}_exps" if experts else f"blk.0.{n}": s for n, s in ffn.items()}
    if arch == "qwen2moe":
        mats |= {f"blk.0.{n}_shexp": s for n, s in ffn.items()}
    if arch == "gemma3":  # a tied table
        del mats["output"]
    for i, (name, (n, k)) in enumerate(mats.items()):
        data = _matrix(qtype, n * (experts if name.endswith("_exps") else 1), k, seed=i)
        if name.endswith("_exps"):
            data = data.reshape(experts, n, -1)
        if tiny_embd and name == "token_embd":
            data = (data.astype(np.float32) * 1e-4).astype(np.float16)
        w.add_tensor(f"{name}.weight", data, raw_dtype=None if qtype == QT.F16 else qtype)
    rng = np.random.default_rng(99)
    norms = {"output_norm": D, "blk.0.attn_norm": D, "blk.0.ffn_norm": D}
    if arch == "gemma3":  # stored as 1 + w; some below 0.5, where the import's w - 1 rounds
        norms |= {"blk.0.post_attention_norm": D, "blk.0.post_ffw_norm": D, "blk.0.attn_q_norm": D // HEADS,
                  "blk.0.attn_k_norm": D // HEADS}
    for name, n in norms.items():
        w.add_tensor(f"{name}.weight", (1 + 0.6 * rng.standard_normal(n)).astype(np.float32))
    if arch in ("qwen2", "qwen2moe"):
        for name, n in (("attn_q", D), ("attn_k", kvd), ("attn_v", kvd)):
            w.add_tensor(f"blk.0.{name}.bias", rng.standard_normal(n).astype(np.float32))
    if experts:
        w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((experts, D)).astype(np.float32))
    if arch == "qwen2moe":
        w.add_tensor("blk.0.ffn_gate_inp_shexp.weight", rng.standard_normal(D).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensor_bytes(path) -> dict[str, tuple[str, list, bytes]]:
    """name -> (kind, shape, stored bytes) of every tensor of a container."""
    ckpt = ContainerCheckpoint(path)
    try:
        return {n: (t.kind, t.shape, ckpt.read_extent(t.file, t.offset, t.nbytes).numpy().tobytes())
                for n, t in ckpt.tensors.items()}
    finally:
        ckpt.close()


def _fields(reader: GGUFReader) -> dict:
    return {k: (f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("qtype,arch,experts", [(t, "llama", 0) for t in EXACT] + [
    (QT.Q4_K, "qwen2", 0), (QT.Q8_0, "qwen2", 0), (QT.Q6_K, "llama", 3), (QT.Q4_0, "qwen2moe", 4),
    (QT.Q4_K, "gemma3", 0)],
    ids=lambda v: v.name if isinstance(v, QT) else str(v))
def test_round_trip_is_byte_identical(tmp_path, qtype, arch, experts):
    src = tiny_gguf(tmp_path / "src.gguf", qtype, arch, experts)
    convert(src, tmp_path / "c1", ConvertOptions())
    report = export.export_gguf(tmp_path / "c1", tmp_path / "out.gguf")
    assert report.requantized == 0
    convert(tmp_path / "out.gguf", tmp_path / "c2", ConvertOptions())
    first, again = _tensor_bytes(tmp_path / "c1"), _tensor_bytes(tmp_path / "c2")
    assert first == again
    assert {kind for kind, _, _ in first.values()} >= {quant.GGUF_EXACT.get(qtype.name, quant.GGUF_K_EXACT.get(
        qtype.name)).name}  # the exact kind really was used
    # the exported file: the source's tensors (types, shapes, bytes: q/k rows back in llama.cpp's order) and metadata
    a, b = GGUFReader(src), GGUFReader(tmp_path / "out.gguf")
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert sorted(ta) == sorted(tb)
    for name, t in ta.items():
        assert (tb[name].tensor_type, list(tb[name].shape)) == (t.tensor_type, list(t.shape)), name
        got, want = np.asarray(tb[name].data), np.asarray(t.data)
        if arch == "gemma3" and name.endswith("norm.weight"):  # 1 + w: the file's value where w did not round
            kept = want >= 0.5
            assert np.array_equal(got[kept], want[kept]) and not kept.all(), name
            assert (np.abs(got - want) <= np.spacing(np.abs(want - 1))).all(), name
            continue
        assert np.array_equal(got, want), name
    fa, fb = _fields(a), _fields(b)
    assert fa == fb
    assert fb["general.architecture"][1] == arch and fb[f"{arch}.attention.head_count_kv"][1] == KV
    assert fb["tokenizer.ggml.tokens"][1] == TOKENS and fb["tokenizer.ggml.merges"][1] == ["Ġ t"]


@pytest.mark.parametrize("qtype,kind", [(QT.Q4_0, "q4_0"), (QT.Q4_1, "q4_1"), (QT.Q8_0, "q8"), (QT.Q5_0, "q5_0"),
                                        (QT.Q4_K, "q4k"), (QT.Q6_K, "q6k"), (QT.Q6_K, "q8k"), (QT.Q3_K, "q3k"),
                                        (QT.IQ4_XS, "iq4_xs"), (QT.IQ4_NL, "iq4_nl"), (QT.Q5_K, "q5k"),
                                        (QT.Q2_K, "q2k"), (QT.Q5_1, "q5_1")])
def test_to_gguf_inverts_from_gguf(qtype, kind):
    n, k = 80, 512  # q4 kinds: a full 64-row tile and a 16-row tail
    raw = _matrix(qtype, n, k, seed=5)
    w = quant.from_gguf(raw, qtype, (n, k))
    w = w.as_q8k() if kind == "q8k" else w  # what older containers hold for Q6_K
    assert w.kind.name == kind and quant.gguf_type(w.kind) == qtype.name
    assert np.array_equal(quant.to_gguf(w), raw)


def test_q8_per_channel_is_q8_0_exactly_and_q4_has_no_type():
    x = torch.randn(48, 256) * 0.02
    q8 = quant.quantize(x, "q8", 0)
    assert quant.gguf_type(q8.kind) == "Q8_0"
    assert torch.equal(torch.from_numpy(gguf_dequantize(quant.to_gguf(q8), QT.Q8_0)), q8.dequantize())
    assert quant.gguf_type(quant.quantize(x, "q4", 64).kind) is None
    tiny = quant.quantize(x * 1e-6, "q8", 0)  # scales below f16's range: Q8_0 cannot hold them
    with pytest.raises(ValueError, match="f16"):
        quant.to_gguf(tiny)


def test_kind_without_gguf_type_is_requantized_with_a_notice(tmp_path, capsys):
    src = tiny_gguf(tmp_path / "f16.gguf", QT.F16)  # F16 matrices: the q4 policy (q4 g64, q8 per channel)
    convert(src, tmp_path / "c", ConvertOptions())
    kinds = {t.kind for t in ContainerCheckpoint(tmp_path / "c").tensors.values()}
    assert {"q4", "q8"} <= kinds
    capsys.readouterr()
    report = export.export_gguf(tmp_path / "c", tmp_path / "out.gguf")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "notice" in line]
    assert len(lines) == 1 and "q4 tensors (group 64) have no GGUF type" in lines[0] and "Q8_0" in lines[0]
    assert report.requantized == sum(k == "q4" for k in (t.kind for t in ContainerCheckpoint(tmp_path / "c")
                                                         .tensors.values()))
    ckpt = ContainerCheckpoint(tmp_path / "c")
    out = {t.name: t for t in GGUFReader(tmp_path / "out.gguf").tensors}
    q8 = next(n for n, t in ckpt.tensors.items() if t.kind == "q8")
    name = export.gguf_tensor_name(q8, "llama")[0]
    assert out[name].tensor_type == QT.Q8_0
    got = gguf_dequantize(np.asarray(out[name].data), QT.Q8_0)
    assert np.array_equal(got, ckpt.load(q8).dequantize().numpy())  # per-channel q8 is exact as Q8_0
    q4 = next(n for n, t in ckpt.tensors.items() if t.kind == "q4" and "mlp" in n)
    got = gguf_dequantize(np.asarray(out[export.gguf_tensor_name(q4, "llama")[0]].data), QT.Q8_0)
    want = ckpt.load(q4).dequantize().numpy()
    assert np.abs(got - want).max() <= np.abs(want).max() / 254 * 1.01  # half a Q8_0 step at most
    convert(tmp_path / "out.gguf", tmp_path / "again", ConvertOptions())  # and it reads back


def test_q8_scales_f16_cannot_hold_are_requantized_with_a_notice(tmp_path, capsys):
    src = tiny_gguf(tmp_path / "f16.gguf", QT.F16, tiny_embd=True)  # token_embd: q8 per channel, scales ~1e-8
    convert(src, tmp_path / "c", ConvertOptions())
    capsys.readouterr()
    report = export.export_gguf(tmp_path / "c", tmp_path / "out.gguf")
    lines = [line for line in capsys.readouterr().err.splitlines() if "model.embed_tokens.weight" in line]
    assert len(lines) == 1 and "outside f16's range" in lines[0] and "re-quantized to Q8_0" in lines[0]
    q4 = sum(t.kind == "q4" for t in ContainerCheckpoint(tmp_path / "c").tensors.values())
    assert report.requantized == q4 + 1
    out = {t.name: t for t in GGUFReader(tmp_path / "out.gguf").tensors}
    assert out["token_embd.weight"].tensor_type == QT.Q8_0


def _edit_manifest(path, edit) -> None:
    mf = path / container.MANIFEST
    m = json.loads(mf.read_text())
    edit(m)
    m["checksum"] = container.manifest_checksum(m)
    mf.write_text(json.dumps(m))


def test_old_container_reads_metadata_from_its_source(tmp_path, capsys):
    src = tiny_gguf(tmp_path / "src.gguf", QT.Q8_0)
    convert(src, tmp_path / "c", ConvertOptions())
    (tmp_path / "c" / container.GGUF_METADATA).unlink()
    _edit_manifest(tmp_path / "c", lambda m: m["tokenizer"].pop("gguf_metadata_file"))
    export.export_gguf(tmp_path / "c", tmp_path / "out.gguf")
    assert "keeps no GGUF metadata" in capsys.readouterr().err
    assert _fields(GGUFReader(src)) == _fields(GGUFReader(tmp_path / "out.gguf"))
    tiny_gguf(src, QT.Q8_0, "qwen2")  # another model at the source's path: its metadata is refused
    assert "does not describe the model" in _cli_error(capsys, "--input", str(tmp_path / "c"), "--output",
                                                        str(tmp_path / "other.gguf"), "--force")
    assert not (tmp_path / "other.gguf").exists()


def _cli_error(capsys, *argv) -> str:
    capsys.readouterr()
    assert cli.main(["convert", *argv]) != 0
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("colibri: ")]  # not the progress lines
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    return errors[0]


def test_bad_input_gets_one_line_and_leaves_no_file(tmp_path, capsys, monkeypatch):
    src = tiny_gguf(tmp_path / "src.gguf", QT.Q4_K)
    convert(src, tmp_path / "c", ConvertOptions())
    c = str(tmp_path / "c")
    assert "no-such-dir" in _cli_error(capsys, "--input", c, "--output", str(tmp_path / "no-such-dir" / "m.gguf"))
    assert "already exists" in _cli_error(capsys, "--input", c, "--output", str(src))
    assert "not a Colibri container" in _cli_error(capsys, "--input", str(src), "--output", str(tmp_path / "x.gguf"))
    # a failure mid-write: nothing left that looks like a GGUF
    calls = []

    def failing(w):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return real(w)

    real = quant.to_gguf
    monkeypatch.setattr(quant, "to_gguf", failing)
    assert "Input/output error" in _cli_error(capsys, "--input", c, "--output", str(tmp_path / "m.gguf"))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "src.gguf"]
    # the kept metadata damaged
    meta = tmp_path / "c" / container.GGUF_METADATA
    good = meta.read_bytes()
    meta.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert "fails its checksum" in _cli_error(capsys, "--input", c, "--output", str(tmp_path / "m.gguf"))
    meta.write_bytes(good)
    # a container converted from HF weights has no GGUF metadata to write back
    _edit_manifest(tmp_path / "c", lambda m: (m["tokenizer"].pop("gguf_metadata_file"),
                                              m["source"].update(kind="huggingface")))
    assert "convert_hf_to_gguf" in _cli_error(capsys, "--input", c, "--output", str(tmp_path / "m.gguf"))
    assert not (tmp_path / "m.gguf").exists()
