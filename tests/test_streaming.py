"""Streaming store: placement changes what is read from disk, never the tokens; faults surface as clear errors."""

from __future__ import annotations

import os

import pytest

import colibri
import colibri.runtime.model
import tiny_models
from colibri.convert import pipeline as conv
from colibri.core.errors import InputError, StorageError
import torch

from colibri.weights import placement
from colibri.weights.streaming import PageState
from faults import FailingReads

PROMPT = tiny_models.token_ids(12, 384, seed=3)


def container_factory(tiny_model_dir, root, options: conv.ConvertOptions):
    """Family -> container converted with `options`, built once."""
    cache = {}

    def get(family):
        if family not in cache:
            conv.convert(tiny_model_dir(family), root / family, options)
            cache[family] = root / family
        return cache[family]

    return get


@pytest.fixture(scope="module")
def containers(tiny_model_dir, tmp_path_factory):
    """Family -> q4 container with 1 MB pages (every layer its own pages), built once."""
    return container_factory(tiny_model_dir, tmp_path_factory.mktemp("stream"),
                             conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))


def total_bytes(m) -> int:
    return sum(p.nbytes for p in m.checkpoint.pages)


def limit_for(path, fraction: float, batch_size: int = 512) -> int:
    """A memory limit: the container's minimum working set (KV cache, activations, staging) plus `fraction` of
    its weight bytes."""
    placement, _, _ = colibri.runtime.model.plan(path, None, batch_size=batch_size)
    return placement.minimum + int(fraction * placement.pinned_bytes)


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_placement_never_changes_tokens(containers, family):
    path = containers(family)
    ref = colibri.load(path).generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids
    size = total_bytes(colibri.load(path))
    configs = [(limit_for(path, 0), 1, 0), (limit_for(path, 0.25), 4, 2), (limit_for(path, 0.5), 2, 4)]
    for limit, io_threads, depth in configs:
        m = colibri.load(path, memory_limit=limit, io_threads=io_threads, prefetch_depth=depth)
        assert m.store.placement.streamed, "the limit must force streaming"
        got = m.generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids  # with the elastic pins
        assert got == ref, (limit, io_threads, depth)
        m.store.hold()  # the placement's own pins: the rest streams on every token
        m.kv.clear()
        got = m.generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids
        assert got == ref, (limit, io_threads, depth)
        assert m.store.stats.bytes_read > size  # streamed pages were read again on later tokens
        m.close()


def test_every_store_has_the_whole_weight_store_protocol(containers):
    """Callers never probe a store for a capability: the RAM, streaming, calibration and probe stores each have
    every method and attribute of WeightStore."""
    from colibri.convert.calibrate import _LayerStore
    from colibri.perf.probes import _ProbeStore
    from colibri.weights.store import RamStore, WeightStore

    members = [n for n in vars(WeightStore) if not n.startswith("_")] + list(WeightStore.__annotations__)
    streaming = colibri.load(containers("llama"), memory_limit=limit_for(containers("llama"), 0.25)).store
    for store in (RamStore({}, torch.float32), streaming, _LayerStore(None, set()),
                  _ProbeStore({}, torch.float32, None, [])):
        assert [n for n in members if not hasattr(store, n)] == [], type(store).__name__
    streaming.close()


def test_dense_sweep_reads_exactly_the_streamed_bytes(containers):
    m = colibri.load(containers("llama"), memory_limit=limit_for(containers("llama"), 0.25),
                     prefetch_depth=0)
    m.store.hold()  # the placement's own pins (the elastic ones are read at load and vary with the KV cache)
    m.store.stats.bytes_read = m.store.placement.pinned_bytes  # as if only those had been read
    p = m.store.placement
    start = m.store.stats.bytes_read  # the pinned pages
    assert start == p.pinned_bytes
    ids = PROMPT[:1]
    r = m.generate(ids, max_tokens=5, ignore_eos=True)  # 5 forward passes (1 prefill + 4 decode steps)
    assert m.store.stats.bytes_read - start == 5 * p.streamed_bytes  # no thrash, no re-reads within a pass
    assert r.stats["disk_bytes_read"] == 5 * p.streamed_bytes and r.stats["io_wait_s"] >= 0
    assert all(m.store.state[i] == PageState.PINNED for i in p.pinned)


def test_budget_below_minimum_is_refused_with_the_minimum(containers):
    with pytest.raises(InputError, match="below this model's minimum working set of .* raise --memory-limit"):
        colibri.load(containers("mixtral"), memory_limit="8K")
    with pytest.raises(InputError, match="not understood"):
        colibri.load(containers("mixtral"), memory_limit="lots")


def test_tight_budgets_read_ahead_as_far_as_they_fit(containers):
    """Between the minimum working set and room for the automatic prefetch depth, the planner reads ahead as many
    pages as its slots allow (it used to fall back to no prefetch at all), and more budget never lowers it."""
    path = containers("llama")
    base, _, _ = colibri.runtime.model.plan(path, None)
    depths = []
    for extra in range(0, base.pinned_bytes + (64 << 10), 4 << 10):  # up to room for every page
        placement, _, _ = colibri.runtime.model.plan(path, base.minimum + extra)
        if placement.streamed:
            depths.append(placement.prefetch_depth)
    assert depths == sorted(depths) and depths[0] == 0
    assert set(depths) == set(range(max(depths) + 1)) and max(depths) >= 2


def test_automatic_depth_counts_the_pages_left_streaming():
    """The automatic prefetch depth is a layer's streamed pages plus one, counted after pinning: once every
    attention page is pinned, a layer streams one page and two pages of read-ahead do; the slot a depth of three
    would take pins one FFN page more, and the FFN pins are spread over the layers."""
    from colibri.formats.container import PageEntry

    mib, pages = 1 << 20, []
    for layer in range(28):  # the 1.5B's shape: a 3 MiB attention page and a 25 MiB FFN page a layer
        for kind, size in (("attention", 3 * mib), ("ffn", 25 * mib)):
            pages.append(PageEntry(len(pages), kind, layer, None, [], 0, len(pages) * 32 * mib, size))
    table = placement.WeightTable(pages, {}, 28, False)
    auto = placement.plan(table, 500 * mib, None)
    deeper = placement.plan(table, 500 * mib, 3)
    assert (auto.prefetch_depth, deeper.prefetch_depth) == (2, 3)
    assert auto.slots == 3 and auto.pinned_bytes == deeper.pinned_bytes + 25 * mib
    ffn = sorted(pages[i].layer for i in auto.pinned if pages[i].kind == "ffn")
    assert all(pages[i].kind == "ffn" for i in auto.streamed) and len(ffn) == 13
    assert all(2 <= b - a <= 4 for a, b in zip(ffn, ffn[1:])), ffn  # never two side by side
    assert placement.plan(table, 150 * mib, None).prefetch_depth == 3  # two pages a layer stream: 3 still


def test_pins_spread_over_the_pass_by_kind():
    """Pins go by kind (attention before the FFN) and, within a kind, spread over the layers: a contiguous run of
    pinned layers computes while the disk has only the prefetch depth's pages to read. Pins grow and shrink at
    the end of one order, so every count of pins is spread: up to half of the layers never two side by side, up
    to three quarters in runs of at most three (a prefix of file order: runs of all of them)."""
    from colibri.formats.container import PageEntry

    for n in (2, 3, 24, 28, 36, 48, 64, 80, 94):
        pages = []
        for layer in range(n):
            for kind in ("ffn", "attention"):
                pages.append(PageEntry(len(pages), kind, layer, None, [], 0, len(pages) * 4096, 4096))
        order = placement.pin_order(pages, reversed(range(len(pages))))
        assert sorted(order) == list(range(len(pages)))
        assert {pages[i].kind for i in order[:n]} == {"attention"} and {pages[i].kind for i in order[n:]} == {"ffn"}
        ffn = [pages[i].layer for i in order[n:]]
        assert ffn[0] == 0
        for k in range(1, n):
            pinned, run, longest = set(ffn[:k]), 0, 0
            for layer in range(n):
                run = run + 1 if layer in pinned else 0
                longest = max(longest, run)
            assert longest <= (1 if 2 * k <= n else 3 if 4 * k <= 3 * n else n), (n, k, sorted(pinned))
    assert placement.pin_order(pages[:1], [0]) == [0] and placement.pin_order(pages, []) == []


def test_memory_limit_needs_a_container(tiny_model_dir):
    with pytest.raises(colibri.UnsupportedModelError, match="colibri convert"):
        colibri.load(tiny_model_dir("llama"), memory_limit="1G")


def test_read_error_names_page_and_file_and_engine_recovers(containers):
    path = containers("qwen3_moe")
    ref = colibri.load(path).generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids
    m = colibri.load(path, memory_limit=limit_for(path, 0.25), prefetch_depth=0)
    m.store.hold()  # the placement's own pins: the rest streams, through the faulty reads
    streamed = m.store.placement.streamed[0]
    page = m.checkpoint.pages[streamed]
    FailingReads(m.store.reader).fail(page.file, page.offset)
    with pytest.raises(StorageError) as info:
        m.generate(PROMPT, max_tokens=8, ignore_eos=True)
    msg = str(info.value)
    assert f"page {streamed}" in msg and "data-00000.bin" in msg and "\n" not in msg
    assert m.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids == ref  # still usable


def test_data_file_truncated_after_load(containers, tmp_path):
    import shutil

    path = tmp_path / "c"
    shutil.copytree(containers("llama"), path)
    m = colibri.load(path, memory_limit=limit_for(path, 0.25), prefetch_depth=0)
    last = m.checkpoint.pages[m.store.placement.streamed[-1]]
    os.truncate(path / "data-00000.bin", last.offset)
    with pytest.raises(StorageError, match="data-00000.bin.*(short read|truncated)"):
        m.generate(PROMPT, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_containers(tiny_model_dir, tmp_path_factory):
    return container_factory(tiny_model_dir, tmp_path_factory.mktemp("stream-bf16"),
                             conv.ConvertOptions(quant="bf16", page_size_mb=1))


@pytest.mark.parametrize("family,kind", [("llama", "q4"), ("llama_tied", "q4"), ("qwen2", "bf16"),
                                         ("gemma3", "bf16"), ("llama", "bf16")])
def test_tables_read_by_rows_and_blocks(containers, bf16_containers, monkeypatch, family, kind):
    """Embedding lookups read only their rows and the head streams its rows in blocks: same tokens, same logits."""
    monkeypatch.setattr(placement, "BLOCK_BYTES", 4096)  # tiny tables: force several blocks
    path = (containers if kind == "q4" else bf16_containers)(family)
    ref = colibri.load(path, batch_size=1)  # same pass shapes: bf16 results depend on them
    want_ids = ref.generate(PROMPT, max_tokens=16, ignore_eos=True).token_ids
    want_logits = ref.logits(PROMPT)
    # one token per pass: the lookup's row buffers stay smaller than the tiny embedding page
    m = colibri.load(path, memory_limit=limit_for(path, 0, 1), prefetch_depth=0, batch_size=1)
    tables = {m.checkpoint.pages[i].kind for i in m.store.placement.by_rows}
    assert "embedding" in tables and (m.args.tie_word_embeddings or "head" in tables)
    assert m.generate(PROMPT, max_tokens=16, ignore_eos=True).token_ids == want_ids
    got = m.logits(PROMPT)
    # q8 tables compute row by row (bit-identical); a bf16 GEMM may accumulate a split vocabulary differently
    assert torch.equal(got, want_logits) if kind == "q4" else torch.allclose(got, want_logits, atol=1e-4, rtol=0)
    assert m.store.stats.row_bytes_read > 0


def test_batch_size_chunks_prefill_reads(containers):
    """A 12-token prompt with --batch-size 5 is three forward passes: the streamed pages are read three times."""
    path = containers("llama")
    m = colibri.load(path, memory_limit=limit_for(path, 0.25), prefetch_depth=0, batch_size=5)
    p = m.store.placement
    before = m.store.stats.bytes_read - m.store.stats.row_bytes_read
    m.generate(PROMPT, max_tokens=1)
    assert m.store.stats.bytes_read - m.store.stats.row_bytes_read - before == 3 * p.streamed_bytes
    with pytest.raises(InputError, match="batch-size"):
        colibri.load(path, batch_size=0)


def test_corrupt_page_is_found_on_first_read(containers, tmp_path):
    import shutil

    path = tmp_path / "c"
    shutil.copytree(containers("llama"), path)
    placement, _, _ = colibri.runtime.model.plan(path, limit_for(path, 0.25), prefetch_depth=0)
    page = colibri.load(path).checkpoint.pages[placement.streamed[-1]]
    with open(path / "data-00000.bin", "r+b") as f:
        f.seek(page.offset + page.nbytes // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    m = colibri.load(path, memory_limit=limit_for(path, 0.25), prefetch_depth=0)  # the bad page is not read yet
    with pytest.raises(StorageError, match=f"page {page.id}: checksum mismatch in .*data-00000.bin"):
        m.generate(PROMPT, max_tokens=4, ignore_eos=True)


def test_data_file_rewritten_after_load_is_refused(containers, tmp_path):
    import shutil

    path = tmp_path / "c"
    shutil.copytree(containers("llama"), path)
    m = colibri.load(path, memory_limit=limit_for(path, 0.25))
    shutil.copy(path / "data-00000.bin", tmp_path / "copy.bin")
    os.replace(tmp_path / "copy.bin", path / "data-00000.bin")  # a different file under the same name
    with pytest.raises(StorageError, match="data-00000.bin changed on disk after the model was loaded"):
        m.generate(PROMPT, max_tokens=2)


def test_expert_cache_learns_and_persists_usage(containers, tmp_path):
    """Experts stay cached between tokens, prefill never evicts the decode set, and usage.json (written at
    close) makes the next load pin the hottest experts; tokens never change."""
    import json
    import shutil

    path = tmp_path / "moe"
    shutil.copytree(containers("qwen3_moe"), path)
    (path / "usage.json").unlink(missing_ok=True)  # other tests' runs wrote their counts
    ref = colibri.load(path).generate(PROMPT, max_tokens=24, ignore_eos=True).token_ids
    pages = colibri.load(path).checkpoint.pages
    dense = sum(p.nbytes for p in pages if p.kind != "expert")
    expert = max(p.nbytes for p in pages if p.kind == "expert")
    _, reserve, _ = colibri.runtime.model.plan(path, None)
    limit = reserve.total + dense + 4 * expert  # every dense page pinned, one staging slot, three cache slots
    m = colibri.load(path, memory_limit=limit, prefetch_depth=0)
    assert m.store.placement.cache_slots >= 3 and m.store.placement.learned_pins == 0
    assert m.generate(PROMPT, max_tokens=24, ignore_eos=True).token_ids == ref
    assert m.store.stats.expert_hits > 0
    decode_set = set(m.store.experts.cached())
    assert decode_set
    m.store.begin_pass(2)  # a prefill pass: only free cache slots may take its experts
    for pid in [p.id for p in pages if p.kind == "expert" and p.id not in decode_set]:
        with m.store.expert(pages[pid].layer, pages[pid].expert):
            pass
    assert decode_set <= set(m.store.experts.cached())
    m.close()
    usage = json.loads((path / "usage.json").read_text())
    assert usage["shape"] == [m.args.num_layers, m.args.num_experts] and sum(map(sum, usage["counts"])) > 0
    m2 = colibri.load(path, memory_limit=limit, prefetch_depth=0)
    assert m2.store.placement.learned_pins > 0
    assert m2.generate(PROMPT, max_tokens=24, ignore_eos=True).token_ids == ref



def test_expert_stats_in_generation(containers):
    path = containers("qwen3_moe")
    m = colibri.load(path, memory_limit=limit_for(path, 0.25))
    stats = m.generate(PROMPT, max_tokens=4, ignore_eos=True).stats
    assert stats["disk_bytes_read"] > 0 and stats["read_gb_per_s"] > 0 and stats["direct_io"] is True
    assert stats["expert_hits"] + stats["expert_misses"] + stats["expert_pinned_uses"] > 0
    assert 0 <= stats["expert_resident_rate"] <= 1 and stats["decode_io_wait_s_per_token"] >= 0


def test_usage_file_from_elsewhere_or_corrupt_is_ignored(containers, tmp_path):
    import json
    import shutil

    path = tmp_path / "moe"
    shutil.copytree(containers("qwen3_moe"), path)
    m = colibri.load(path)
    shape = [m.args.num_layers, m.args.num_experts]
    hot = [[100.0] * shape[1] for _ in range(shape[0])]
    limit = limit_for(path, 0.5)
    for text in (json.dumps({"version": 1, "container": "another", "shape": shape, "counts": hot}),
                 json.dumps({"version": 1, "container": "x", "shape": [1, 1], "counts": [[1]]}), "{not json"):
        (path / "usage.json").write_text(text)
        assert colibri.load(path, memory_limit=limit).store.placement.learned_pins == 0
