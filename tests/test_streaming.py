"""Streaming store: placement changes what is read from disk, never the tokens; faults surface as clear errors."""

from __future__ import annotations

import os

import pytest

import colibri
import tiny_models
from colibri import convert as conv
from colibri.errors import InputError, StorageError
from colibri.streaming import PageState

PROMPT = tiny_models.token_ids(12, 384, seed=3)


@pytest.fixture(scope="module")
def containers(tiny_model_dir, tmp_path_factory):
    """Family -> q4 container with 1 MB pages (every layer its own pages), built once."""
    root = tmp_path_factory.mktemp("stream")
    cache = {}

    def get(family):
        if family not in cache:
            out = root / family
            conv.convert(tiny_model_dir(family), out, conv.ConvertOptions(quant="q4", group_size=32,
                                                                            page_size_mb=1))
            cache[family] = out
        return cache[family]

    return get


def total_bytes(m) -> int:
    return sum(p["nbytes"] for p in m.checkpoint.pages)


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_placement_never_changes_tokens(containers, family):
    path = containers(family)
    ref = colibri.load(path).generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids
    size = total_bytes(colibri.load(path))
    configs = [(size // 2, 1, 0), (size // 2, 4, 2), (size * 3 // 4, 2, 4)]
    for limit, io_threads, depth in configs:
        m = colibri.load(path, memory_limit=limit, io_threads=io_threads, prefetch_depth=depth)
        assert m.store.placement.streamed, "the limit must force streaming"
        got = m.generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids
        assert got == ref, (limit, io_threads, depth)
        assert m.store.stats.bytes_read > size  # streamed pages were read again on later tokens
        m.close()


def test_dense_sweep_reads_exactly_the_streamed_bytes(containers):
    m = colibri.load(containers("llama"), memory_limit=total_bytes(colibri.load(containers("llama"))) // 2,
                     prefetch_depth=0)
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


def test_memory_limit_needs_a_container(tiny_model_dir):
    with pytest.raises(colibri.UnsupportedModelError, match="colibri convert"):
        colibri.load(tiny_model_dir("llama"), memory_limit="1G")


def test_read_error_names_page_and_file_and_engine_recovers(containers):
    path = containers("qwen3_moe")
    ref = colibri.load(path).generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids
    m = colibri.load(path, memory_limit=total_bytes(colibri.load(path)) // 2, prefetch_depth=0)
    streamed = m.store.placement.streamed[0]
    page = m.checkpoint.pages[streamed]
    m.store.reader.inject_error(page["file"], page["offset"])
    with pytest.raises(StorageError) as info:
        m.generate(PROMPT, max_tokens=8, ignore_eos=True)
    msg = str(info.value)
    assert f"page {streamed}" in msg and "data-00000.bin" in msg and "\n" not in msg
    assert m.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids == ref  # still usable


def test_data_file_truncated_after_load(containers, tmp_path):
    import shutil

    path = tmp_path / "c"
    shutil.copytree(containers("llama"), path)
    m = colibri.load(path, memory_limit=total_bytes(colibri.load(path)) // 2, prefetch_depth=0)
    last = m.checkpoint.pages[m.store.placement.streamed[-1]]
    os.truncate(path / "data-00000.bin", last["offset"])
    with pytest.raises(StorageError, match="data-00000.bin.*(short read|truncated)"):
        m.generate(PROMPT, max_tokens=4, ignore_eos=True)
