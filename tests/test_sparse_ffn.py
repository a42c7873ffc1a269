"""LOSSY sparse FFN: `colibri calibrate`'s sidecar (deterministic, bound to its container) and `--sparse-ffn`
(bit-identical to dense at thresholds 0, batch-invariant at any thresholds, counted in the model's stats)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import colibri
import tiny_models
from clirun import here
from colibri.convert import pipeline as conv
from colibri.core.errors import InputError
from colibri.models.base import Batch
from colibri.runtime import sparse_calibrate, sparsity
from colibri.weights.usage import ExpertUsage

DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
TEXT = "def f(x):\n    return x * 2\n\nThe quick brown fox jumps over the lazy dog.\n" * 20


@pytest.fixture(scope="module")
def containers(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse_ffn")
    out = {}
    for fam in DENSE:
        out[fam] = root / fam
        conv.convert(tiny_model_dir(fam), out[fam], conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))
    (root / "calib.txt").write_text(TEXT)
    return out, root / "calib.txt"


@pytest.fixture(scope="module")
def calibrated(containers):
    """qwen2 calibrated at a mean sparsity of 0.5 on TEXT."""
    paths, text = containers
    out, side = sparse_calibrate.calibrate(paths["qwen2"], [str(text)], target=0.5, tokens=128)
    return paths["qwen2"], out, side


def ids(vocab: int, n: int = 24, seed: int = 3) -> list[int]:
    return tiny_models.token_ids(n, vocab, seed=seed)


def zero_sidecar(path, dest):
    """A sidecar for the container at `path` with every threshold 0 (nothing but exact zeros masked)."""
    m = colibri.load(path)
    try:
        a = m.args
        side = sparsity.Sidecar(ExpertUsage.identity_of(m.checkpoint), sparsity.chunk_size(m.checkpoint, a),
                                [0.0] * a.num_layers, [torch.arange(a.intermediate_size)] * a.num_layers)
    finally:
        m.close()
    side.save(dest)
    return dest


@pytest.mark.parametrize("fam", DENSE)
def test_thresholds_zero_give_the_dense_logits_bit_for_bit(containers, fam, tmp_path):
    paths, _ = containers
    side = zero_sidecar(paths[fam], tmp_path / "zero.safetensors")
    with colibri.load(paths[fam]) as dense, colibri.load(paths[fam], sparse_ffn=str(side)) as sparse:
        x = ids(dense.args.vocab_size)
        assert torch.equal(dense.logits(x), sparse.logits(x))
        stats = sparse.stats()
        assert stats["ffn_bytes_needed_per_token"] == stats["ffn_dense_bytes_per_token"] > 0


def test_calibration_is_deterministic_and_reaches_its_target(containers, calibrated, tmp_path):
    path, out, side = calibrated
    _, text = containers
    again, _ = sparse_calibrate.calibrate(path, [str(text)], target=0.5, tokens=128, output=str(tmp_path / "again"))
    a, b = (sparsity.Sidecar.load(p, side.identity, len(side.thresholds)) for p in (out, again))
    assert a.thresholds == b.thresholds and a.info == b.info and a.chunk == b.chunk
    assert all(torch.equal(x, y) for x, y in zip(a.order, b.order))
    assert side.info["target_sparsity"] == 0.5
    assert sum(side.info["layer_sparsity"]) / len(side.info["layer_sparsity"]) >= 0.5
    for o in side.order:  # each layer's order is a permutation of its neurons
        assert torch.equal(o.sort().values, torch.arange(o.numel()))
    assert side.info["perplexity_sparse"] != side.info["perplexity_dense"]


def test_a_sidecar_of_another_container_is_refused(containers, calibrated):
    paths, _ = containers
    _, out, _ = calibrated
    with pytest.raises(InputError, match="calibrated for another container"):
        colibri.load(paths["llama"], sparse_ffn=str(out))
    with pytest.raises(InputError, match="colibri calibrate"):
        colibri.load(paths["llama"], sparse_ffn="default")  # none calibrated there


def test_sparse_ffn_skips_neurons_and_counts_them(calibrated):
    path, out, side = calibrated
    with colibri.load(path) as dense, colibri.load(path, sparse_ffn=str(out)) as sparse:
        x = ids(dense.args.vocab_size, n=64, seed=11)
        assert not torch.equal(dense.logits(x), sparse.logits(x))
        s = sparse.stats()
    assert 0.3 < s["ffn_sparsity"] < 0.7
    assert s["ffn_bytes_needed_per_token_union"] <= s["ffn_bytes_needed_per_token"] <= s["ffn_dense_bytes_per_token"]


def test_sparse_rows_do_not_depend_on_their_batch_mates(calibrated):
    """Each row is masked by its own gate row; the pass's union of chunks changes nothing in a row."""
    path, out, _ = calibrated
    with colibri.load(path, sparse_ffn=str(out)) as m:
        a, b = ids(m.args.vocab_size, 20, seed=5), ids(m.args.vocab_size, 13, seed=6)

        @torch.inference_mode()  # as the engine runs it (the torch tier's KV writes need it)
        def forward(parts):
            caches = [m.new_cache() for _ in parts]
            for p, c in zip(parts, caches):
                c.reserve(len(p))
            return m.decoder.forward(m.store, Batch.pack([(p, 0, c, 0) for p, c in zip(parts, caches)]))

        alone = forward([a])
        together = forward([b, a])
    assert torch.equal(alone, together[len(b):])


def test_the_coactivation_order_preserves_the_function(tiny_model_dir, calibrated):
    """Permuting the intermediate neurons (gate and up rows, down columns) by the calibrated order leaves the
    logits unchanged to float tolerance."""
    _, _, side = calibrated
    with colibri.load(tiny_model_dir("qwen2"), dtype="float32") as m:
        x = ids(m.args.vocab_size)
        ref = m.logits(x)
        t = m.store.tensors
        for i, o in enumerate(side.order):
            g, u, d = sparsity.ffn_names(i)
            t[g], t[u], t[d] = t[g][o].contiguous(), t[u][o].contiguous(), t[d][:, o].contiguous()
        got = m.logits(x)
    assert not torch.equal(side.order[0], torch.arange(side.order[0].numel()))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_coactivation_order_groups_neurons_that_fire_together():
    # neurons 0, 2, 4, 6 fire on even tokens, 1, 3, 5, 7 on odd ones: chunks of 4 keep each set together
    t = torch.arange(16)[:, None] % 2 == torch.arange(8)[None, :] % 2
    o = sparse_calibrate.coactivation_order(t, 4)
    assert sorted(o[:4].tolist()) in ([0, 2, 4, 6], [1, 3, 5, 7])
    assert sorted(o[4:].tolist()) in ([0, 2, 4, 6], [1, 3, 5, 7])


def test_calibrate_and_run_on_the_command_line(tiny_model_dir, containers, tmp_path, capsys):
    paths, text = containers
    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("llama"), src)  # with a word-level tokenizer, so that `run` takes text
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(src / "tokenizer.json"))
    c = tmp_path / "c"
    conv.convert(src, c, conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))
    (tmp_path / "words.txt").write_text(" ".join(f"w{(i * 7) % 300}" for i in range(400)))
    r = here(capsys, "calibrate", "--model", str(c), "--text", str(tmp_path / "words.txt"),
             "--calibration-tokens", "96", "--max-ppl-increase", "5")
    assert r.returncode == 0, r.stderr
    assert "perplexity on the calibration text" in r.stderr and (c / sparsity.SIDECAR).exists()
    r = here(capsys, "run", "--model", str(c), "--sparse-ffn", "--raw", "--json", "--max-tokens", "4",
             "--prompt", "w5 w6 w7")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]["model"]
    assert stats["sparse_ffn"] and 0 <= stats["ffn_sparsity"] <= 1
    assert stats["ffn_bytes_needed_per_token"] <= stats["ffn_dense_bytes_per_token"]
    r = here(capsys, "calibrate", "--model", str(c), "--target-sparsity", "0.5", "--max-ppl-increase", "2")
    assert r.returncode == 2 and "not both" in r.stderr
    r = here(capsys, "run", "--model", str(paths["qwen2"]), "--sparse-ffn", str(c / sparsity.SIDECAR),
             "--prompt", "x")
    assert r.returncode == 2 and "another container" in r.stderr and r.stderr.count("\n") == 1


def test_bench_reports_the_sparse_ffn(calibrated, capsys):
    path, out, _ = calibrated
    r = here(capsys, "bench", "--model", str(path), "--sparse-ffn", str(out), "--tokens", "3", "--probe-seconds",
             "0.05", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["sparse_ffn"]
    assert 0 < s["ffn_sparsity"] < 1 and s["ffn_bytes_needed_per_token"] <= s["ffn_dense_bytes_per_token"]
    r = here(capsys, "bench", "--model", str(path), "--sparse-ffn", str(out), "--tokens", "3", "--probe-seconds",
             "0.05")
    assert r.returncode == 0 and "LOSSY sparse FFN" in r.stdout


def test_allocations_reach_the_mean_target():
    # layer 0's error grows fast, layer 1's slowly: the greedy allocation sparsifies layer 1 first
    n = len(sparse_calibrate.LEVELS)
    errors = {0: [i * 1.0 for i in range(n)], 1: [i * 0.01 for i in range(n)]}
    uniform = sparse_calibrate.allocate(errors, 0.3)
    assert uniform[0] == uniform[1] and sparse_calibrate.LEVELS[uniform[0]] >= 0.3
    greedy = sparse_calibrate.allocate(errors, 0.3, "greedy")
    assert greedy[1] > greedy[0] and sum(sparse_calibrate.LEVELS[v] for v in greedy.values()) / 2 >= 0.3
