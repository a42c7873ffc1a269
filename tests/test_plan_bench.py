"""`colibri plan` and `colibri bench` on tiny q4 containers: consistent numbers, bytes per token as actually read,
one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import colibri
import colibri.runtime.model
from colibri import cli
from colibri.weights import placement
from colibri.perf import predict
from clirun import here
from test_streaming import containers  # noqa: F401 - the fixture: family -> tiny q4 container, 1 MB pages

PROBE = ["--probe-seconds", "0.05"]


def minimum(path, batch_size: int = 512) -> int:
    """The smallest limit the container runs in: every page that can be is streamed."""
    placement, _, _ = colibri.runtime.model.plan(path, None, batch_size=batch_size)
    return placement.minimum


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    p = here(capsys, *argv)  # in this process through cli.main (tests/clirun.py)
    return p.returncode, p.stdout, p.stderr


def plan_json(capsys, *argv) -> dict:
    code, out, err = run_cli(capsys, "plan", *argv, *PROBE, "--json")
    assert code == 0, err
    return json.loads(out)


def check_consistent(r: dict) -> None:
    """Page groups add up to the container; the prediction is the smaller bound; bytes per token add up."""
    p, kinds = r["placement"], r["pages"]["by_kind"]
    total = r["pages"]["total_bytes"]
    assert p["pinned_bytes"] + p["streamed_bytes"] + p["by_rows_bytes"] == total
    assert sum(v["total"] for v in kinds.values()) == total
    for v in kinds.values():
        assert v["pinned"] + v["streamed"] + v["by_rows"] == v["total"]
    assert sum(v["pinned"] for v in kinds.values()) == p["pinned_bytes"]
    t = r["per_token"]
    assert t["total_bytes"] == t["streamed_bytes"] + t["head_row_bytes"] + t["lookup_row_bytes"] + t["expert_bytes"]
    io, cpu = r["io_bound_tokens_per_s"], r["compute_bound_tokens_per_s"]
    assert cpu == pytest.approx(1 / r["compute"]["s_per_token"]) and cpu > 0
    if t["total_bytes"]:
        assert io == pytest.approx(r["disk"]["bytes_per_s"] / t["total_bytes"])
        assert r["bound_tokens_per_s"] == min(io, cpu) and r["bound"] == ("io" if io < cpu else "compute")
    else:
        assert io is None and r["bound_tokens_per_s"] == cpu and r["bound"] == "compute"
    # the pipeline model never beats full overlap of reads and compute
    assert 0 < r["predicted_tokens_per_s"] <= r["bound_tokens_per_s"] * (1 + 1e-9)
    assert r["predicted_tokens_per_s"] == pytest.approx(1 / r["pipeline"]["s_per_token"])


def test_plan_dense_json(containers, capsys):
    path = containers("llama")
    r = plan_json(capsys, "--model", path, "--memory-limit", minimum(path) + 64 * 1024)
    check_consistent(r)
    assert r["placement"]["streamed_pages"] > 0 and r["experts"] is None
    assert r["per_token"]["streamed_bytes"] == r["placement"]["streamed_bytes"] > 0
    assert r["disk"]["file"] == str(path / "data-00000.bin") and r["disk"]["bytes_per_s"] > 0
    assert r["compute"]["threads"] >= 1 and r["compute"]["layers"]["dense"]["layers"] == 2
    assert r["reserve"]["total_bytes"] == r["placement"]["reserve_bytes"]
    assert r["runtime_baseline_rss_bytes"] > 0 and "outside --memory-limit" in r["runtime_baseline_note"]


def test_plan_moe_json_expected_experts(containers, capsys):
    path = containers("qwen3_moe")
    (path / "usage.json").unlink(missing_ok=True)  # no learned pins: the expected misses follow from the limit
    r = plan_json(capsys, "--model", path, "--memory-limit", minimum(path) + 96 * 1024)
    check_consistent(r)
    e = r["per_token"]["experts"]
    assert r["experts"] == {"num_experts": 4, "top_k": 2} and "random routing" in e["assumption"]
    assert sum(x["cache_slots"] for x in e["layers"]) == pytest.approx(r["placement"]["expert_cache_slots"])
    for x in e["layers"]:
        assert x["streamed_experts"] + x["pinned_experts"] == 4
        assert x["miss_probability"] == pytest.approx(max(0, x["streamed_experts"] - x["cache_slots"]) / 4, abs=1e-6)
        assert x["expected_bytes"] == pytest.approx(2 * x["miss_probability"] * x["expert_bytes"], abs=1)
    assert r["per_token"]["expert_bytes"] == pytest.approx(sum(x["expected_bytes"] for x in e["layers"]), abs=2)
    expert_pages = r["pages"]["by_kind"]["expert"]
    assert expert_pages["streamed"] > 0
    streamed_non_expert = r["placement"]["streamed_bytes"] - expert_pages["streamed"]
    assert r["per_token"]["streamed_bytes"] == streamed_non_expert


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
@pytest.mark.parametrize("by_rows", [True, False])
def test_dense_bytes_per_token_is_what_a_decode_step_reads(containers, monkeypatch, family, by_rows):
    """Streamed pages (a tied embedding staged whole twice: lookup and head), or the head's row blocks and one
    lookup row when the tables are read by rows: the plan's bytes per token, counted per decode step."""
    if by_rows:
        monkeypatch.setattr(placement, "BLOCK_BYTES", 4096)  # tiny tables: the head streams in several blocks
    batch = 1 if by_rows else 512  # one token per pass: the lookup's row buffers stay smaller than the table
    path = containers(family)
    limit = minimum(path, batch_size=batch)
    r = predict.layout(path, limit, prefetch_depth=0, batch_size=batch).as_dict()
    t = r["per_token"]
    assert (t["head_row_bytes"] > 0 and t["lookup_row_bytes"] > 0) == by_rows and t["streamed_bytes"] > 0
    if family == "llama_tied" and not by_rows:  # the embedding page serves two scopes per pass
        embedding = r["pages"]["by_kind"]["embedding"]["streamed"]
        assert t["streamed_bytes"] == r["placement"]["streamed_bytes"] > 2 * embedding > 0
    m = colibri.load(path, memory_limit=limit, prefetch_depth=0, batch_size=batch)
    m.store.hold()  # the planned placement: elastic pins are beyond what layout predicts
    stats, seen = m.store.stats, []
    for chunk in m.stream([1, 2, 3], max_tokens=5, ignore_eos=True):
        seen.append((stats.bytes_read - stats.row_bytes_read, stats.row_bytes_read))
    m.close()
    steps = [(a1 - a0, r1 - r0) for (a0, r0), (a1, r1) in zip(seen[:-2], seen[1:-1])]  # token chunks only
    assert len(steps) == 4
    for whole, rows in steps:
        assert whole == t["streamed_bytes"]
        assert 0 <= rows - t["head_row_bytes"] <= t["lookup_row_bytes"] and (rows > 0) == by_rows


@pytest.mark.parametrize("head_s, depth, slots, want", [
    (10, 0, 1, 14),  # no prefetch: every page read on demand, nothing overlaps
    (10, 4, 5, 10),  # the next pass's 4 pages are read during the head: compute-bound
    (1, 4, 5, 4),  # the same reads take longer than all compute: the disk's 4 s
    (10, 2, 3, 12),  # only 2 pages are read during the head; the other 2 wait for the disk
])
def test_pipeline_model(head_s, depth, slots, want):
    """4 layers of one 1 MiB page each (1 s at 1 MiB/s, no compute) and a head computing for head_s."""
    scopes = [predict.PassStep([k], k + 1) for k in range(4)] + [predict.PassStep([], 4, compute_s=head_s)]
    got = predict.pipeline(scopes, [1 << 20] * 4, 1 << 20, slots, depth)
    assert got["s_per_token"] == pytest.approx(want)
    assert got["io_wait_s"] == pytest.approx(want - head_s)


def test_pipeline_model_compute_slower_while_reading():
    """Compute twice as slow while the disk reads: the head does 2 s of its work in the 4 s of reads, then 8 s."""
    scopes = [predict.PassStep([k], k + 1) for k in range(4)] + [predict.PassStep([], 4, compute_s=10)]
    got = predict.pipeline(scopes, [1 << 20] * 4, 1 << 20, 5, 4, slowdown=2.0)
    assert got["s_per_token"] == pytest.approx(12) and got["io_wait_s"] == pytest.approx(0)


@pytest.mark.parametrize("head_s, want", [
    (1, 4.5),  # 0.5 MiB read during the 1 s head at half rate, the other 3.5 MiB after it
    (4, 6.0),  # 2 MiB during the head, 2 MiB after it
    (10, 10.0),  # all 4 MiB within the head's 10 s even at half rate: compute-bound
])
def test_pipeline_model_disk_slower_while_computing(head_s, want):
    """The disk reads at half its rate while compute runs (reads slow under a matmul on this VM)."""
    scopes = [predict.PassStep([k], k + 1) for k in range(4)] + [predict.PassStep([], 4, compute_s=head_s)]
    got = predict.pipeline(scopes, [1 << 20] * 4, 1 << 20, 5, 4, busy_bandwidth=1 << 19)
    assert got["s_per_token"] == pytest.approx(want) and got["io_wait_s"] == pytest.approx(want - head_s)


def test_pipeline_model_never_reads_faster_while_computing():
    """A busy-disk probe above the idle one (the host cache's noise) is taken as the idle rate, so the model never
    beats its I/O bound: 4 MiB a pass at 1 MiB/s is at least 4 s."""
    scopes = [predict.PassStep([k], k + 1) for k in range(4)] + [predict.PassStep([], 4, compute_s=1)]
    fast = predict.pipeline(scopes, [1 << 20] * 4, 1 << 20, 5, 4, busy_bandwidth=1 << 21)
    same = predict.pipeline(scopes, [1 << 20] * 4, 1 << 20, 5, 4)
    assert fast["s_per_token"] == pytest.approx(same["s_per_token"]) and fast["s_per_token"] >= 4


def test_plan_without_limit_is_all_resident(containers, capsys):
    path = containers("llama")
    r = plan_json(capsys, "--model", path)
    check_consistent(r)
    assert r["all_resident"] and r["memory_limit_bytes"] is None and r["disk"] is None
    assert r["placement"]["pinned_bytes"] == r["pages"]["total_bytes"]
    code, out, _ = run_cli(capsys, "plan", "--model", path, *PROBE)
    assert code == 0 and "every page resident" in out and "compute-bound" in out


def test_bench_json_reports_measured_and_predicted(containers, capsys):
    path = containers("llama")
    # 24 tokens: a tiny random model soon repeats itself, where the engine would try n-gram drafts (11 of them
    # before); the bench runs plain one-token steps, each reading a pass's bytes as the plan counts them
    code, out, err = run_cli(capsys, "bench", "--model", path, "--memory-limit", minimum(path) + 64 * 1024,
                             "--tokens", "24", "--prefetch-depth", "0", *PROBE, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["decode_steps"] == 23 and r["decode_tokens_per_s"] > 0 and r["ttft_s"] > 0
    assert r["plan"]["placement"]["row_read_pages"] == 0  # tiny tables are staged whole: no lookup row varies
    assert r["decode_bytes_per_token"] == r["plan"]["per_token"]["total_bytes"]
    assert r["decode_bytes_read"] == 23 * r["decode_bytes_per_token"] and r["prefill_bytes_read"] > 0
    achieved = r["decode_bytes_read"] / r["decode_read_s"]  # bytes/s while a read was in flight
    assert r["io_bound_tokens_per_s"] == pytest.approx(achieved / r["decode_bytes_per_token"], rel=1e-4)
    best = min(r["io_bound_tokens_per_s"], r["compute_bound_tokens_per_s"])
    assert r["ratio_to_bound"] == pytest.approx(r["decode_tokens_per_s"] / best, rel=1e-3)
    assert r["prediction_error_pct"] == pytest.approx(
        100 * (r["decode_tokens_per_s"] / r["predicted_tokens_per_s"] - 1), abs=0.01)
    assert r["placement_as_planned"] and r["cold_start"]["files_dropped_from_page_cache"] >= 2
    assert r["peak_rss_bytes"] >= r["runtime_baseline_rss_bytes"] > 0
    assert 0 <= r["decode_hit_rate_bytes"] <= 1 and r["generation"]["generated_tokens"] == 24
    assert r["generation"]["draft_tokens"] == 0  # plain steps: no n-gram drafts verified


def test_bench_without_limit_has_no_io_bound(containers, capsys):
    code, out, err = run_cli(capsys, "bench", "--model", containers("llama"), "--tokens", "3", *PROBE)
    assert code == 0, err
    line = out.strip()
    assert "\n" not in line and "I/O bound none" in line and "decode" in line and "predicted" in line


@pytest.mark.parametrize("argv, message", [
    (["plan", "--memory-limit", "8K"], "below this model's minimum working set"),
    (["plan", "--memory-limit", "lots"], "not understood"),
    (["bench", "--tokens", "1"], "--tokens must be at least 2"),
    (["bench", "--ctx-length", "100000"], "--ctx-length 100000 is outside"),
    (["bench", "--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_errors_are_one_line(containers, capsys, argv, message):
    code, out, err = run_cli(capsys, *argv, "--model", containers("llama"), *PROBE)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_plan_needs_a_container(tiny_model_dir, capsys):
    code, _, err = run_cli(capsys, "plan", "--model", tiny_model_dir("llama"), "--memory-limit", "1G")
    assert code == 2 and err.count("\n") == 1 and "convert" in err


@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["chat"]])
def test_run_and_chat_pass_ctx_length_and_batch_size(monkeypatch, capsys, command):
    seen = {}

    def fake_load(config, **kwargs):  # the CLI passes one EngineConfig
        seen.update(vars(config))
        raise colibri.InputError("stop here")

    monkeypatch.setattr(colibri.runtime.model, "load", fake_load)
    code, _, err = run_cli(capsys, *command, "--model", "x", "--ctx-length", "128", "--batch-size", "16",
                           "--memory-limit", "300M")
    assert code == 2 and "stop here" in err
    assert seen["ctx_length"] == 128 and seen["batch_size"] == 16 and seen["memory_limit"] == "300M"


def test_streaming_dense_runs_ask_openmp_workers_to_sleep(containers, monkeypatch, tmp_path):
    """Dense containers larger than the limit get OMP_WAIT_POLICY=PASSIVE (spinning workers slowed reads by a
    quarter); MoE, all-resident runs and unreadable paths do not; the choice is made before torch loads."""
    dense, moe = containers("llama"), containers("mixtral")

    def args(model, limit):
        return cli.build_parser().parse_args(["run", "--model", str(model), "--prompt", "x"]
                                             + (["--memory-limit", limit] if limit else []))

    assert cli.streams_dense(args(dense, "64K"))
    assert not cli.streams_dense(args(dense, None)) and not cli.streams_dense(args(dense, "1G"))
    assert not cli.streams_dense(args(moe, "64K"))
    assert not cli.streams_dense(args(tmp_path / "missing", "64K"))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli.quiet_openmp(args(dense, "64K"))  # torch is already loaded here: too late, nothing is changed
    assert "OMP_WAIT_POLICY" not in os.environ
    code = ("import os, sys; from colibri import cli; "
            f"cli.quiet_openmp(cli.build_parser().parse_args(['run', '--model', {str(dense)!r}, '--prompt', 'x', "
            "'--memory-limit', '64K'])); print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["PASSIVE", "False"]


def test_pipeline_model_wake_up_after_long_waits():
    """Compute after a wait of wake_gap_s or more first spends wake_s: no prefetch, four 1 s reads, each layer
    then computes 0.5 s (+0.25 s waking); with the gap above the waits, nothing is added."""
    scopes = [predict.PassStep([k], k + 1, compute_s=0.5) for k in range(4)]
    slow = predict.pipeline(scopes, [1 << 20] * 4, 1 << 20, 1, 0, wake_s=0.25, wake_gap_s=0.5)
    fast = predict.pipeline(scopes, [1 << 20] * 4, 1 << 20, 1, 0, wake_s=0.25, wake_gap_s=2.0)
    assert slow["s_per_token"] == pytest.approx(4 * 1.75) and fast["s_per_token"] == pytest.approx(4 * 1.5)


def test_plan_predicts_the_elastic_pins_a_decode_starts_with(containers):
    """Under a limit sized for a long context, a decode's first passes pin more pages in the room the context's KV
    reserve leaves: the plan names them, and the bytes a decode step then reads are the ones it predicts."""
    path = containers("llama")
    limit = minimum(path, batch_size=1)  # a 256-token context's KV reserve; the pins leave one page streaming
    lay = predict.layout(path, limit, prefetch_depth=0, batch_size=1)
    start = lay.with_elastic_pins()
    assert lay.elastic_pins and set(lay.elastic_pins) <= set(lay.placement.streamed)
    assert not set(lay.elastic_pins) & set(start.placement.streamed)
    assert 0 < start.per_token["streamed_bytes"] < lay.per_token["streamed_bytes"]
    assert lay.as_dict()["elastic_pins"]["pages"] == len(lay.elastic_pins)
    m = colibri.load(path, memory_limit=limit, prefetch_depth=0, batch_size=1, draft_tokens=0)
    m.store.elastic.baseline = None  # what the KV cache and the pass hold, not this process's RSS (other tests')
    stats, seen = m.store.stats, []
    for _ in m.stream([1, 2, 3], max_tokens=5, ignore_eos=True):
        seen.append(stats.bytes_read - stats.row_bytes_read)
    pinned = m.store.elastic.pinned_bytes
    m.close()
    assert pinned == start.placement.pinned_bytes
    steps = [b - a for a, b in zip(seen[1:-2], seen[2:-1])]  # decode steps after the pins were made
    assert steps and all(s == start.per_token["streamed_bytes"] for s in steps), steps


def test_layers_whose_weights_differ_in_kind_are_timed_apart():
    """A K-quant GGUF keeps some layers' weights wider (Q4_K_M: Q6_K ffn_down in about half the layers): the compute
    probe times each group of layers that share their weights' kinds, not the first layer for all of them."""
    from types import SimpleNamespace

    from colibri.perf.probes import MAX_GROUPS, layer_groups

    def model(kinds_of):  # layer i's ffn_down kind
        n = len(kinds_of)
        args = SimpleNamespace(num_layers=n, moe_layers=[False] * n)
        decoder = SimpleNamespace(layer_prefix=lambda i: f"layers.{i}.")
        shapes = {f"layers.{i}.{w}": (4, 4) for i in range(n) for w in ("up", "down", "norm")}
        entries = {f"layers.{i}.{w}": SimpleNamespace(kind=kinds_of[i] if w == "down" else "q4k")
                   for i in range(n) for w in ("up", "down")}
        return layer_groups(args, decoder, shapes, entries)

    g = model(["q6k", "q4k", "q4k", "q6k", "q4k"])
    assert g == {"dense": (False, [1, 2, 4], {"q4k": 2}), "dense 2": (False, [0, 3], {"q4k": 1, "q6k": 1})}
    many = model([f"k{i}" for i in range(MAX_GROUPS + 3)])
    assert len(many) == MAX_GROUPS
    assert sorted(i for _, idx, _ in many.values() for i in idx) == list(range(MAX_GROUPS + 3))
