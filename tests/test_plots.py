"""`colibri plan --plot` and `colibri bench --plot`: the placement per layer and the per-scope timeline drawn into
image files (matplotlib, the `plots` extra; skipped without it)."""

from __future__ import annotations

import pytest

from colibri import cli
from colibri.convert import pipeline as conv
from colibri.core.errors import InputError

pytest.importorskip("matplotlib", reason="the plots extra: pip install -e .[plots]")

from colibri.perf import plots, runner  # noqa: E402


@pytest.fixture(scope="module")
def container(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("plots") / "c"
    conv.convert(tiny_model_dir("llama"), out, conv.ConvertOptions(quant="q8", page_size_mb=1))
    return out


def test_plan_plot_draws_the_placement(container, tmp_path, capsys):
    lay = runner.layout(container, None, None, None, None, 16)
    limit = lay.placement.minimum + lay.placement.pinned_bytes // 3
    out = tmp_path / "plan.png"
    assert cli.main(["plan", "--model", str(container), "--memory-limit", str(limit), "--probe-seconds", "0.05",
                     "--plot", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_timeline_plot_from_a_bench_run(container, tmp_path):
    lay = runner.layout(container, None, None, None, None, 16)
    limit = lay.placement.minimum + lay.placement.pinned_bytes // 3
    report = runner.run_bench(container, memory_limit=limit, tokens=3, probe_seconds=0.05, timeline_passes=3)
    assert {e["pass"] for e in report.timeline} == {1, 2, 3}  # the prompt's pass, then decode steps
    assert all(e["compute_ms"] >= 0 and e["wait_ms"] >= 0 for e in report.timeline)
    out = plots.timeline_plot(report.timeline, tmp_path / "t.svg", "tiny llama")
    assert "tiny llama" in out.read_text()  # SVG keeps text as text
    with pytest.raises(InputError, match="nothing streamed"):
        plots.timeline_plot([], tmp_path / "none.png")
