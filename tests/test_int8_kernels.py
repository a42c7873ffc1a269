"""The LOSSY int8-activation kernels (colibri.kernels, int8.cpp; `--lossy-int8-activations`): batch-invariant like
the exact ones, close to the dequantized math, and off by default (the exact kernels' results unchanged)."""

from __future__ import annotations

import pytest
import torch

from colibri import kernels
from colibri.kernels import ops
from colibri.quant.kinds import quantize

ROWS = (1, 3, 16, 64)
# relative error (Frobenius) against f64 math on the dequantized weights: measured 0.54-0.69 % on Gaussian x
# (bf16 x through the exact kernels: 0.23-0.29 %), 1.1-2.6 % with one input channel 30x the others (its group's
# int8 step grows with it; g128 worst)
REL_BOUND, REL_BOUND_OUTLIER = 0.01, 0.04


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _int8_reset(monkeypatch):
    kernels.use("auto")  # the best native tier this machine builds, whatever COLIBRI_KERNELS says
    monkeypatch.delenv(kernels.LOSSY_INT8_ENV, raising=False)
    yield
    kernels.set_int8_activations(None)
    kernels.use(None)


@pytest.fixture
def int8():
    kernels.set_int8_activations(True)
    if not kernels.int8_activations():
        pytest.skip("no AVX-512 VNNI or native kernels on this machine")


def _weight(kind: str, n: int, k: int):
    name, g = kind.split("g")
    return quantize(_randn(n, k, seed=1) * 0.1, name, int(g))


# q8 with x groups of 64 or more runs the dot form up to 16 rows and the quads form above (the same int32 sums, the
# same f32 steps): T = 64 against solo rows crosses it; g32 runs the quads form at every T
KINDS = ["q4g32", "q4g64", "q4g128", "q8g0", "q8g32", "q8g128"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_do_not_depend_on_the_pass(int8, kind, dtype):
    w = _weight(kind, 200, 256)  # 200 rows: a q4 tail tile of 16 rows, a q8 tile of 8 columns
    x = _randn(max(ROWS), 256, seed=2).to(dtype)
    solo = torch.cat([ops.linear(x[i:i + 1], w) for i in range(x.shape[0])])
    for t in ROWS:
        y = ops.linear(x[:t], w)
        assert y.dtype == dtype and y.shape == (t, 200)
        assert torch.equal(y, solo[:t]), f"{kind} {dtype} T={t}: rows differ from their solo runs"


@pytest.mark.parametrize("kind", KINDS)
def test_int8_error_against_the_dequantized_weights_is_bounded(int8, kind):
    w = _weight(kind, 200, 256)
    x = _randn(16, 256, seed=4)
    for scale, bound in ((1, REL_BOUND), (30, REL_BOUND_OUTLIER)):
        x[:, 7] *= scale  # an outlier channel: only its own group's steps grow
        ref = x.double() @ w.dequantize().double().T
        got = ops.linear(x, w).double()
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < bound, (scale, rel)
    kernels.set_int8_activations(False)
    exact = ops.linear(x, w).double()
    assert ((exact - ref).norm() / ref.norm()).item() < 1e-6  # f32 x: the exact path is exact
    assert not torch.equal(got, exact)  # the int8 path did run


@pytest.mark.parametrize("kind", ["q4g64", "q8g0"])
def test_off_by_default_and_unsupported_shapes_stay_exact(kind):
    """Without the option the exact kernels run (their results as before); K not a multiple of 64 always does."""
    assert not kernels.int8_activations()
    w, x = _weight(kind, 64, 256), _randn(5, 256, seed=5).bfloat16()
    b = w.buffers()
    direct = (kernels.library().q4_linear(x, b["qweight"], b["scales_zeros"], 64) if kind == "q4g64"
              else kernels.library().q8_linear(x, b["qweight"], b["scales"], 0)) if kernels.native() else None
    if direct is not None:
        assert torch.equal(ops.linear(x, w), direct[:, :64])
    kernels.set_int8_activations(True)
    w96, x96 = _weight(kind.replace("g64", "g32"), 64, 96), _randn(5, 96, seed=6)
    on = ops.linear(x96, w96)
    kernels.set_int8_activations(False)
    assert torch.equal(on, ops.linear(x96, w96))


def test_engine_config_turns_it_on(int8, tiny_model_dir, tmp_path):
    """`lossy_int8_activations=True` reaches the kernels; a q4 model in that mode gives the same logits in one
    prefill pass as in 5-token chunks, and stays close to the exact mode. The mode is the model's own: a LOSSY model
    and an exact one held in one process, in either order of loading, each compute as they would alone (the mode
    was the process's, so the last load decided it for both)."""
    import colibri
    from colibri.convert.pipeline import ConvertOptions, convert

    convert(tiny_model_dir("llama"), tmp_path / "q4", ConvertOptions(quant="q4", group_size=32))
    ids = [(7 * i + 3) % 384 for i in range(24)]
    kernels.set_int8_activations(None)
    with colibri.load(tmp_path / "q4") as m:
        exact = m.logits(ids)
    with colibri.load(tmp_path / "q4", lossy_int8_activations=True) as m:
        assert m.decoder.lossy_int8 and not kernels.int8_activations()  # (outside its passes: the process's)
        whole = m.logits(ids)
        chunked = torch.cat(list(m.engine.score(ids, chunk=5)))
    assert torch.equal(whole, chunked)
    assert not torch.equal(whole, exact)
    assert (whole - exact).abs().mean() / exact.abs().mean() < 0.05
    for lossy_first in (True, False):
        with colibri.load(tmp_path / "q4", lossy_int8_activations=lossy_first) as a, \
                colibri.load(tmp_path / "q4", lossy_int8_activations=not lossy_first) as b:
            lossy, plain = (a, b) if lossy_first else (b, a)
            for _ in range(2):
                assert torch.equal(plain.logits(ids), exact)
                assert torch.equal(lossy.logits(ids), whole)
    with colibri.load(tmp_path / "q4") as m:  # a model loaded without the option: the process's mode
        kernels.set_int8_activations(True)
        try:
            assert torch.equal(m.logits(ids), whole)
        finally:
            kernels.set_int8_activations(None)
        assert torch.equal(m.logits(ids), exact)


def test_a_model_it_cannot_apply_to_says_so(int8, tiny_model_dir, tmp_path, capsys):
    """Issue 29, item 15: `--lossy-int8-activations` on a model whose weights the int8 kernels cannot take (float
    weights, a checkpoint that is not a container) ran exact without a word."""
    import colibri
    from colibri.convert.pipeline import ConvertOptions, convert

    src = tiny_model_dir("llama")
    convert(src, tmp_path / "q4", ConvertOptions(quant="q4", group_size=32))
    convert(src, tmp_path / "bf16", ConvertOptions(quant="bf16"))
    for path, said in ((src, "do not apply to a"), (tmp_path / "bf16", "this container has no q4/q8/q4k/q8k"),
                       (tmp_path / "q4", None)):
        colibri.load(path, lossy_int8_activations=True).close()
        err = capsys.readouterr().err
        if said is None:
            assert "lossy int8" not in err, err
        else:
            assert said in err and "running exact" in err and err.count("lossy int8") == 1, err
