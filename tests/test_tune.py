"""`colibri tune`: the search and the 3 % rule with a fake bench (a profile that does not win by 3 % on
confirmation is not written; decode and prefill settings kept apart), the profile picked up by run/serve/batch's
config unless an option sets the value, and one real search on a tiny container (the other OpenMP wait policy
measured in a child process)."""

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


def fake_bench(rates: dict, prefill: dict | None = None):
    """decode tok/s by io_threads, prefill tok/s by batch_size (None: refused); any other setting gives the
    default's rate."""
    calls = []

    def bench(settings: dict, objective: str) -> float | None:
        calls.append((settings, objective))
        if objective == "prefill":
            return (prefill or {}).get(settings["batch_size"], 100.0)
        return rates.get(settings["io_threads"], 10.0)
    return bench, calls


def test_a_gain_under_3_percent_writes_no_profile(container, limit):
    bench, calls = fake_bench({3: 10.2})  # io_threads 3 looks 2 % faster
    report = tune.tune(container, limit, repeats=2, bench=bench, log=lambda text: None)
    assert report["decode"]["candidate"] == {"io_threads": 3} and report["gain_pct"] == 2.0
    assert not report["decode"]["kept"] and report["settings"] == report["default"]
    assert not report["written"] and not (container / tune.PROFILE).exists()
    decode = [c for c in calls if c[1] == "decode"]
    assert [c[0] for c in decode[-4:]] == [report["default"], {**report["default"], "io_threads": 3}] * 2
    # every knob was tried: the OpenMP wait policy's other value too
    policies = {c[0]["omp_wait_policy"] for c in decode}
    assert policies == {tune.omp_policy(), *tune.POLICIES}
    assert {c[0]["batch_size"] for c in calls if c[1] == "prefill"} == {256, 512, 1024}


def test_a_prefill_win_is_kept_alone_and_a_refused_size_skipped(container, limit):
    bench, calls = fake_bench({}, prefill={1024: None, 256: 110.0})  # 1024 tokens a pass do not fit
    report = tune.tune(container, limit, repeats=2, bench=bench, log=lambda text: None)
    assert report["written"] and report["settings"] == {**report["default"], "batch_size": 256}
    assert report["gain_pct"] == 0.0 and report["prefill_gain_pct"] == 10.0
    assert all(t["settings"]["batch_size"] != 1024 for t in report["tried"])  # refused: not ranked
    no_prefill, _ = fake_bench({}, prefill={256: 110.0})
    report = tune.tune(container, limit, repeats=1, prefill_tokens=0, bench=no_prefill, log=lambda text: None)
    assert not report["written"] and report["prefill"] == {"gain_pct": 0.0, "kept": False}


def test_a_win_is_written_and_picked_up_unless_an_option_is_given(container, limit, capsys, monkeypatch):
    bench, _ = fake_bench({3: 11.0}, prefill={1024: 120.0})
    report = tune.tune(container, limit, repeats=2, bench=bench, log=lambda text: None)
    assert report["written"] and report["gain_pct"] == 10.0 and report["prefill_gain_pct"] == 20.0
    saved = json.loads((container / tune.PROFILE).read_text())
    assert saved["settings"]["io_threads"] == 3 and saved["memory_limit_bytes"] == limit
    assert saved["settings"]["batch_size"] == 1024

    def config(*extra):
        args = cli.build_parser().parse_args(["run", "--model", str(container), *extra, "hi"])
        return cli.engine_config(args)

    cfg = config("--memory-limit", str(limit))
    assert (cfg.io_threads, cfg.batch_size) == (3, 1024)
    err = capsys.readouterr().err
    assert "tuned profile" in err and "--io-threads 3" in err and "--batch-size 1024" in err
    cfg = config("--memory-limit", str(limit), "--io-threads", "4", "--batch-size", "64")  # the options win
    assert (cfg.io_threads, cfg.batch_size) == (4, 64)
    assert "--io-threads" not in capsys.readouterr().err
    assert config("--memory-limit", str(limit + 4096)).io_threads == 2  # another limit: not this profile
    assert "tuned profile" not in capsys.readouterr().err

    # the OpenMP wait policy is set before torch loads (in a real `colibri run`), unless the user set one
    saved["settings"]["omp_wait_policy"] = "ACTIVE"
    (container / tune.PROFILE).write_text(json.dumps(saved))
    args = cli.build_parser().parse_args(["run", "--model", str(container), "--memory-limit", str(limit), "hi"])
    assert cli.tuned_openmp(args) == "ACTIVE"
    args = cli.build_parser().parse_args(["run", "--model", str(container), "--memory-limit", str(limit + 1), "hi"])
    assert cli.tuned_openmp(args) is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # as quiet_openmp leaves it in a fresh process
    config("--memory-limit", str(limit))
    assert "OMP_WAIT_POLICY=ACTIVE" in capsys.readouterr().err
    (container / tune.PROFILE).write_text("{broken")
    assert config("--memory-limit", str(limit)).io_threads == 2  # a damaged profile is ignored


def test_a_real_search_on_a_tiny_container(container, limit, capsys):
    assert cli.main(["tune", "--model", str(container), "--memory-limit", str(limit), "--tokens", "3",
                     "--repeats", "1", "--prefill-tokens", "40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tried"][0]["settings"] == report["default"] and all(t["tok_s"] > 0 for t in report["tried"])
    # the other OpenMP wait policy was measured in a child process
    assert {t["settings"]["omp_wait_policy"] for t in report["tried"]} == {tune.omp_policy(), *tune.POLICIES}
    assert {t["objective"] for t in report["tried"]} == {"decode", "prefill"}
    assert report["written"] == (container / tune.PROFILE).exists()
    assert not report["written"] or report["decode"]["kept"] or report["prefill"]["kept"]
    for stage in ("decode", "prefill"):
        assert not report[stage]["kept"] or report[stage]["gain_pct"] >= 3.0
