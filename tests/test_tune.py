"""`colibri tune`: the search and the 3 % rule with a fake bench (a profile that does not win by 3 % on
confirmation is not written), the profile picked up by run/serve/batch's config unless an option sets the value,
and one real search on a tiny container."""

from __future__ import annotations

import json

import pytest

from colibri import cli
from colibri.convert import pipeline as conv
from colibri.perf import tune
from colibri.perf.runner import layout


@pytest.fixture(scope="module")
def container(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "c"
    conv.convert(tiny_model_dir("llama"), out, conv.ConvertOptions(quant="q8", page_size_mb=1))
    return out


@pytest.fixture()
def limit(container):
    lay = layout(container, None, None, None, None, 16)
    yield lay.placement.minimum + lay.placement.pinned_bytes // 2
    (container / tune.PROFILE).unlink(missing_ok=True)


def fake_bench(rates: dict):
    """tok/s by io_threads (every other setting: the default's rate)."""
    calls = []

    def bench(settings: dict) -> float:
        calls.append(settings)
        return rates.get(settings["io_threads"], 10.0)
    return bench, calls


def test_a_gain_under_3_percent_writes_no_profile(container, limit):
    bench, calls = fake_bench({3: 10.2})  # io_threads 3 looks 2 % faster
    report = tune.tune(container, limit, repeats=2, bench=bench, log=lambda text: None)
    assert report["settings"]["io_threads"] == 3 and report["gain_pct"] == 2.0
    assert not report["written"] and not (container / tune.PROFILE).exists()
    assert calls[-4:] == [report["default"], report["settings"]] * 2  # confirmed interleaved with the default


def test_a_win_is_written_and_picked_up_unless_an_option_is_given(container, limit, capsys):
    bench, _ = fake_bench({3: 11.0})
    report = tune.tune(container, limit, repeats=2, bench=bench, log=lambda text: None)
    assert report["written"] and report["gain_pct"] == 10.0
    saved = json.loads((container / tune.PROFILE).read_text())
    assert saved["settings"]["io_threads"] == 3 and saved["memory_limit_bytes"] == limit

    def config(*extra):
        args = cli.build_parser().parse_args(["run", "--model", str(container), *extra, "hi"])
        return cli.engine_config(args)

    assert config("--memory-limit", str(limit)).io_threads == 3
    err = capsys.readouterr().err
    assert "tuned profile" in err and "--io-threads 3" in err
    assert config("--memory-limit", str(limit), "--io-threads", "4").io_threads == 4  # the option wins
    assert "--io-threads" not in capsys.readouterr().err
    assert config("--memory-limit", str(limit + 4096)).io_threads == 2  # another limit: not this profile
    assert "tuned profile" not in capsys.readouterr().err
    (container / tune.PROFILE).write_text("{broken")
    assert config("--memory-limit", str(limit)).io_threads == 2  # a damaged profile is ignored


def test_a_real_search_on_a_tiny_container(container, limit, capsys):
    assert cli.main(["tune", "--model", str(container), "--memory-limit", str(limit), "--tokens", "3",
                     "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tried"][0]["settings"] == report["default"] and all(t["tok_s"] > 0 for t in report["tried"])
    assert report["written"] == (container / tune.PROFILE).exists()
    assert not report["written"] or report["gain_pct"] >= 3.0
