"""Calibrated q4: activation statistics from a calibration text, the weighted fit, a mixed-precision plan chosen
from measured sensitivity under a size budget, deterministic and resumable."""

from __future__ import annotations

import json

import pytest
import torch

import colibri
from colibri.convert import calibrate
from colibri.convert import mixed
from colibri.convert import pipeline as conv
from colibri.core.errors import InputError



def manifest(path):
    return json.loads((path / "manifest.json").read_text())


@pytest.fixture(scope="module")
def calibrated(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrated")
    text = root / "calib.txt"
    text.write_text("def f(x):\n    return x * 2\n\nThe quick brown fox jumps over the lazy dog.\n" * 40)
    opts = conv.ConvertOptions(quant="q4", group_size=32, calibration=str(text), calibration_tokens=512)
    out = {}
    for name in ("a", "b"):
        conv.convert(tiny_model_dir("qwen2"), root / name, opts)
        out[name] = root / name
    return out, text


def test_calibrated_conversion_is_deterministic(calibrated):
    (paths, _) = calibrated
    a, b = (manifest(paths[k]) for k in ("a", "b"))
    assert [t["checksum"] for t in a["tensors"]] == [t["checksum"] for t in b["tensors"]]
    assert a["quant"]["policy"]["mixed"] == b["quant"]["policy"]["mixed"]
    ca, cb = (calibrate.Calibration.load(paths[k] / calibrate.CALIBRATION) for k in ("a", "b"))
    assert ca.sensitivity == cb.sensitivity and ca.importance.keys() == cb.importance.keys()
    assert all(torch.equal(ca.importance[n], cb.importance[n]) for n in ca.importance)


def test_calibration_is_recorded_and_used(calibrated, tiny_model_dir):
    (paths, _) = calibrated
    m = manifest(paths["a"])
    mixed_ = m["quant"]["policy"]["mixed"]
    assert mixed_["calibration"]["tokens"] == 512
    cal = calibrate.Calibration.load(paths["a"] / calibrate.CALIBRATION)
    q4 = [t["name"] for t in m["tensors"] if t["kind"] == "q4"]
    assert q4 and all(n in cal.importance for n in q4)
    assert all(v >= 0 for v in cal.sensitivity.values()) and cal.sensitivity
    # the q4 weights are the importance-weighted fit of the source, not the plain one
    src = colibri.load(tiny_model_dir("qwen2"), dtype="float32").store
    got = colibri.load(paths["a"], dtype="float32").store
    name = q4[1]
    w = src.get(name)
    plain = conv.quant.quantize(w, "q4", 32)
    weighted = conv.quant.quantize(w, "q4", 32, importance=cal.importance[name])
    assert torch.equal(got.get(name).dequantize(), weighted.dequantize())
    assert not torch.equal(weighted.dequantize(), plain.dequantize())


def test_budget_decides_the_q8_set(tiny_model_dir, tmp_path):
    """A larger --bits-per-weight buys more q8 tensors, chosen by measured sensitivity per byte; a budget below
    q4 alone is refused."""
    src = tiny_model_dir("llama")
    sizes, q8 = [], []
    for bpw in (6.0, 7.0, 9.0):
        dst = tmp_path / f"b{bpw}"
        conv.convert(src, dst, conv.ConvertOptions(quant="q4", group_size=32, bits_per_weight=bpw,
                                                   calibration="builtin", calibration_tokens=256))
        rec = manifest(dst)["quant"]["policy"]["mixed"]
        assert rec["bits_per_weight"] <= bpw
        sizes.append(rec["bits_per_weight"])
        q8.append(set(rec["q8"]))
    assert sizes == sorted(sizes) and q8[0] <= q8[1] <= q8[2] and len(q8[2]) > len(q8[0])
    with pytest.raises(InputError, match="bits-per-weight"):
        conv.convert(src, tmp_path / "tiny", conv.ConvertOptions(quant="q4", group_size=32, bits_per_weight=4.0,
                                                                 calibration="builtin", calibration_tokens=256))


def test_choose_spends_the_budget_on_sensitivity_per_byte():
    shape = (256, 256)
    cands = {n: (shape, ("q4", 64)) for n in "abc"}
    q4, q8 = mixed.extent("q4", shape, 64), mixed.extent("q8", shape, 0)
    kinds, total = mixed.choose(cands, {"a": 1.0, "b": 3.0, "c": 2.0}, 0, 3 * q4 + 2 * (q8 - q4), strict=True)
    assert {n for n, k in kinds.items() if k[0] == "q8"} == {"b", "c"} and total == 3 * q4 + 2 * (q8 - q4)


def test_q4_k_m_reference_size():
    """llama.cpp's Q4_K_M of Qwen2.5-0.5B's shapes, computed from its rules, is the GGUF's tensor bytes minus
    the untied output table (the container stores the tied table once, at the head's Q8_0 size)."""
    d, f, v, n = 896, 4864, 151936, 24
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (128, d),
                       p + "self_attn.v_proj.weight": (128, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    got = mixed.q4_k_m_bytes(shapes, n, tied=True)
    # the GGUF's tensors measured 485,452,288 bytes (token_embd Q5_0, output Q8_0); these shapes leave out its
    # norms and biases (~0.3 MB)
    assert abs(got - (485_452_288 - v * d * 5.5 / 8)) < 0.002 * got


def test_interrupted_conversion_resumes_without_recalibrating(tiny_model_dir, tmp_path, monkeypatch):
    """The calibration is kept in the partial directory: a resumed conversion reuses it and writes the same
    container as an uninterrupted one."""
    src = tiny_model_dir("llama_tied")
    opts = conv.ConvertOptions(quant="q4", group_size=32, calibration="builtin", calibration_tokens=256)
    real_write = conv.write_container

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "write_container", crash)
    with pytest.raises(KeyboardInterrupt):
        conv.convert(src, tmp_path / "c", opts)
    partial = list(tmp_path.glob("c.partial-*"))
    assert len(partial) == 1 and (partial[0] / calibrate.CALIBRATION).is_file()
    monkeypatch.setattr(conv, "write_container", real_write)

    def no_second_run(*a, **k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(calibrate, "calibrate", no_second_run)
    conv.convert(src, tmp_path / "c", opts)
    monkeypatch.undo()
    conv.convert(src, tmp_path / "fresh", opts)
    got, want = manifest(tmp_path / "c"), manifest(tmp_path / "fresh")
    assert [t["checksum"] for t in got["tensors"]] == [t["checksum"] for t in want["tensors"]]


def test_fixed_mix_keeps_the_policy_kinds_with_the_weighted_fit(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    conv.convert(src, tmp_path / "fixed", conv.ConvertOptions(quant="q4", group_size=32, mix="fixed",
                                                             calibration="builtin", calibration_tokens=256))
    conv.convert(src, tmp_path / "plain", conv.ConvertOptions(quant="q4", group_size=32, calibration="none"))
    fixed, plain = manifest(tmp_path / "fixed"), manifest(tmp_path / "plain")
    assert [(t["name"], t["kind"]) for t in fixed["tensors"]] == [(t["name"], t["kind"]) for t in plain["tensors"]]
    assert fixed["quant"]["policy"]["mixed"]["mix"] == "fixed"
    q4 = [t["name"] for t in fixed["tensors"] if t["kind"] == "q4" and t["role"] != "embedding"]
    sums = {t["name"]: t["checksum"] for t in plain["tensors"]}
    assert all(t["checksum"] != sums[t["name"]] for t in fixed["tensors"] if t["name"] in q4)


def test_calibrating_a_moe_model_runs_its_experts_through_the_calibration_store(tiny_model_dir, tmp_path):
    """The calibration store has the whole WeightStore protocol: a MoE block asks it whether to read the next
    layer's experts ahead (no), and the calibrated container generates."""
    conv.convert(tiny_model_dir("qwen3_moe"), tmp_path / "moe", conv.ConvertOptions(
        quant="q4", group_size=32, calibration="builtin", calibration_tokens=64))
    assert manifest(tmp_path / "moe")["quant"]["policy"]["mixed"]
    assert len(colibri.load(tmp_path / "moe").generate([1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2
