"""KV cache: offload to the swap file, q8, prefix reuse and saved sessions never change tokens; bad swap files,
full disks and sessions of another model are refused with one clear line."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import colibri
from colibri.kv import session
from colibri.kv import swap
from colibri.core.errors import InputError
from colibri.kernels import ops
from colibri.kv.cache import KVCache, block_for
from colibri.kv.pool import BlockPool, KVLayout
from colibri.kv.swap import SwapSlots

PROMPT = list(range(5, 75))
BLOCK = 4  # small blocks: a 12-token window over a 110-token sequence spills and reads back many blocks


def load(path, tmp_path, window: int | None = None, **kw):
    """Tiny model in f32 with 4-token blocks; `window` tokens of KV in RAM (None: all), the rest in a swap file."""
    m = colibri.load(path, dtype=kw.pop("dtype", "float32"), kv_block=BLOCK, batch_size=kw.pop("batch_size", 8),
                     swap_dir=tmp_path / "swap", **kw)
    if window is not None:
        m.close()
        m = colibri.load(path, dtype=m.dtype, kv_block=BLOCK, batch_size=m.batch_size, swap_dir=tmp_path / "swap",
                         kv_ram=window * m.kv_plan.layout.token_bytes, **kw)
        assert m.kv_plan.window == window
    return m


# llama: dense; gemma3: sliding-window layers (blocks outside the window are not read back); mixtral: MoE
@pytest.mark.parametrize("family", ["llama", "gemma3", "mixtral"])
def test_offload_is_exact(tiny_model_dir, tmp_path, family):
    path = tiny_model_dir(family)
    ram, off = load(path, tmp_path), load(path, tmp_path, window=12)
    assert torch.equal(ram.logits(PROMPT), off.logits(PROMPT))  # same values reach attention: bit-identical
    a = ram.generate(PROMPT, max_tokens=40, ignore_eos=True)
    b = off.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert a.token_ids == b.token_ids
    lay = off.kv_plan.layout
    assert b.stats["kv_disk_bytes"] >= (len(PROMPT) + 39 - 12 - BLOCK) // BLOCK * lay.block_bytes
    assert b.stats["kv_written_bytes"] > 0 and b.stats["kv_read_bytes_per_token"] > 0
    assert a.stats["kv_disk_bytes"] == a.stats["kv_read_bytes"] == 0
    off.close()
    assert not list((tmp_path / "swap").glob("*")), "the temporary swap file is deleted on close"


def test_sliding_window_layers_read_back_only_their_window(tiny_model_dir, tmp_path):
    m = load(tiny_model_dir("gemma3"), tmp_path, window=12)
    r = m.generate(PROMPT, max_tokens=30, ignore_eos=True)
    lay, args = m.kv_plan.layout, m.args
    sliding = sum(1 for t in args.layer_types if t == "sliding_attention")
    assert sliding and args.sliding_window < 64
    # per decode step a full layer reads every block on disk, a sliding one at most window/block + 1 of them
    on_disk = (len(PROMPT) + 29 - 12) // BLOCK + 1
    bound = ((args.num_layers - sliding) * on_disk + sliding * (args.sliding_window // BLOCK + 2)) * lay.seg_bytes
    assert 0 < r.stats["kv_read_bytes_per_token"] <= bound


def test_q8_is_lossy_but_close_and_placement_exact(tiny_model_dir, tmp_path):
    path = tiny_model_dir("mixtral")
    ref = load(path, tmp_path).logits(PROMPT)
    q = load(path, tmp_path, kv_quant="q8")
    qo = load(path, tmp_path, window=12, kv_quant="q8")
    lq = q.logits(PROMPT)
    assert torch.equal(lq, qo.logits(PROMPT))
    assert not torch.equal(lq, ref)
    assert (lq - ref).abs().mean() < 0.05 * ref.abs().mean()  # tiny random models: quality is measured on SmolLM2
    a, lay = q.args, q.kv_plan.layout  # int8 values and one f32 scale per group of a head vector
    assert lay.token_bytes == a.num_layers * 2 * a.num_kv_heads * (a.head_dim + a.head_dim // lay.group * 4)
    assert q.generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids == \
        qo.generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_prefix_reuse_is_exact(tiny_model_dir, tmp_path, family, window):
    path = tiny_model_dir(family)
    m = load(path, tmp_path, window)
    first = m.generate(PROMPT, max_tokens=30, ignore_eos=True).token_ids
    longer = PROMPT + first[:25] + [7, 8, 9]
    r = m.generate(longer, max_tokens=20, ignore_eos=True)
    assert r.stats["prefix_tokens"] == len(PROMPT) + 25
    assert r.stats["prefill_tokens_computed"] == 3
    fresh = load(path, tmp_path, window)
    assert r.token_ids == fresh.generate(longer, max_tokens=20, ignore_eos=True).token_ids


def test_prefix_cache_serves_a_switched_conversation(tiny_model_dir, tmp_path):
    """Two requests sharing a system prefix, then the first again: the live sequence serves the shared part, and
    the first request's own blocks come back from the trie (RAM, or the swap file when offloading)."""
    path = tiny_model_dir("llama")
    system = list(range(40, 80))
    a, b = system + list(range(100, 130)), system + list(range(200, 220))
    probe = load(path, tmp_path)
    lay = probe.kv_plan.layout
    room = 256 * lay.token_bytes + 40 * lay.block_bytes  # the context in RAM, and 40 cached blocks
    for m in (load(path, tmp_path, kv_ram=room), load(path, tmp_path, window=12)):
        ra = m.generate(a, max_tokens=10, ignore_eos=True)
        rb = m.generate(b, max_tokens=10, ignore_eos=True)
        assert rb.stats["prefix_tokens"] == len(system)
        ra2 = m.generate(a, max_tokens=10, ignore_eos=True)
        assert ra2.stats["prefix_tokens"] >= (len(a) - 1) // BLOCK * BLOCK
        assert ra2.token_ids == ra.token_ids
        assert m.stats()["prefix_cache_blocks"] > 0
        m.close()


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_session_save_restore_is_exact(tiny_model_dir, tmp_path, family, window):
    path = tiny_model_dir(family)
    m = load(path, tmp_path, window)
    first = m.generate(PROMPT, max_tokens=21, ignore_eos=True).token_ids
    cached = len(PROMPT) + 20  # the last sampled token was never fed back
    f = m.save_session(tmp_path / "s.kv", [{"role": "user", "content": "x"}])
    nxt = PROMPT + first + [11, 12, 13]
    uninterrupted = m.generate(nxt, max_tokens=20, ignore_eos=True)
    m.close()
    m2 = load(path, tmp_path, window)  # a new process would see the same: nothing is shared but the file
    assert m2.load_session(f) == [{"role": "user", "content": "x"}]
    r = m2.generate(nxt, max_tokens=20, ignore_eos=True)
    assert r.stats["prefix_tokens"] == cached
    assert r.stats["prefill_tokens_computed"] == len(nxt) - cached
    assert r.token_ids == uninterrupted.token_ids


def test_block_size_follows_the_model_and_never_changes_tokens(tiny_model_dir, tmp_path):
    # 64 tokens, halved while a block exceeds 4 MiB: Llama-2-7B's 0.5 MiB per bf16 position gets 16-token blocks
    # (8 MiB), the Mixtral shape 32, SmolLM2 and Qwen2.5-1.5B keep 64
    shapes = {(32, 32, 128): 16, (32, 8, 128): 32, (30, 3, 64): 64, (28, 2, 128): 64}
    assert {s: block_for(*s, torch.bfloat16, None) for s in shapes} == shapes
    assert block_for(32, 32, 128, torch.bfloat16, "q8") == 16
    path = tiny_model_dir("llama")
    got = {}
    for block in (None, 4, 16):
        m = colibri.load(path, dtype="float32", kv_block=block, swap_dir=tmp_path / "swap")
        got[m.kv.layout.block] = m.generate(PROMPT, max_tokens=12, ignore_eos=True).token_ids
        m.close()
    assert set(got) == {64, 4, 16} and got[4] == got[16] == got[64]


def test_session_of_another_model_or_setting_is_refused(tiny_model_dir, tmp_path):
    m = load(tiny_model_dir("llama"), tmp_path)
    m.generate(PROMPT, max_tokens=5, ignore_eos=True)
    f = m.save_session(tmp_path / "s.kv")
    with pytest.raises(InputError, match="saved for another model or setting: model"):
        load(tiny_model_dir("mistral"), tmp_path).load_session(f)
    with pytest.raises(InputError, match="kv_quant None"):
        load(tiny_model_dir("llama"), tmp_path, kv_quant="q8").load_session(f)
    with pytest.raises(InputError, match="dtype 'float32'"):
        load(tiny_model_dir("llama"), tmp_path, dtype="bfloat16").load_session(f)
    with pytest.raises(InputError, match=r"block 4 \(this run: 8\)"):  # the block size is part of the layout
        colibri.load(tiny_model_dir("llama"), dtype="float32", kv_block=8, swap_dir=tmp_path / "swap").load_session(f)
    raw = f.read_bytes()
    bad = tmp_path / "bad.kv"
    bad.write_bytes(raw.replace(b'"version": 2', b'"version": 9', 1))
    with pytest.raises(InputError, match="format version 9"):
        m.load_session(bad)
    bad.write_bytes(raw[:-100])
    with pytest.raises(InputError, match="truncated or damaged"):
        m.load_session(bad)
    flipped = bytearray(raw)
    flipped[-10] ^= 0xFF
    bad.write_bytes(bytes(flipped))
    with pytest.raises(InputError, match="fails its checksum"):
        m.load_session(bad)
    bad.write_bytes(b"hello")
    with pytest.raises(InputError, match="not a Colibri conversation file"):
        m.load_session(bad)


def test_a_changed_byte_in_a_saved_sessions_header_is_refused(tiny_model_dir, tmp_path):
    """The header holds the messages and token ids: "hello" -> "jello" in a saved message, a token id changed, a
    damaged checksum key or version digit must not load as a different history."""
    m = load(tiny_model_dir("llama"), tmp_path)
    m.generate(PROMPT, max_tokens=5, ignore_eos=True)
    f = m.save_session(tmp_path / "s.kv", messages=[{"role": "user", "content": "hello"}])
    assert m.load_session(f) == [{"role": "user", "content": "hello"}]
    raw = f.read_bytes()
    first = str(PROMPT[0])
    other = first[:-1] + str((int(first[-1]) + 1) % 10)  # another id of the same width
    cases = {"message": raw.replace(b'"hello"', b'"jello"', 1),
             "token id": raw.replace(f'"ids": [{first},'.encode(), f'"ids": [{other},'.encode(), 1),
             "version digit": raw.replace(b'"version": 2', b'"version": 1', 1)}
    for what, data in cases.items():
        assert data != raw, what
        bad = tmp_path / "bad.kv"
        bad.write_bytes(data)
        with pytest.raises(InputError, match="header fails its checksum"):
            m.load_session(bad)
    bad.write_bytes(raw.replace(b'"header_crc32"', b'"header_crc3X"', 1))
    with pytest.raises(InputError, match="header fails its checksum"):
        m.load_session(bad)
    # issue 29, item 11: a version-1 header (no checksum of its own) with a damaged key was a KeyError
    v1 = raw.replace(b'"version": 2', b'"version": 1', 1)
    v1 = re.sub(rb', "header_crc32": "[0-9a-f]{8}"', lambda mt: b" " * len(mt.group()), v1, count=1)  # same size
    bad.write_bytes(v1)
    assert m.load_session(bad) == [{"role": "user", "content": "hello"}]  # an intact version-1 file still loads
    for key in (b'"crc32"', b'"ids"', b'"messages"'):
        bad.write_bytes(v1.replace(key, key[:-2] + b'X"', 1))
        with pytest.raises(InputError, match="header lacks a valid"):
            m.load_session(bad)


def test_session_save_is_atomic(tiny_model_dir, tmp_path, monkeypatch):
    m = load(tiny_model_dir("llama"), tmp_path)
    m.generate(PROMPT, max_tokens=5, ignore_eos=True)
    f = m.save_session(tmp_path / "s.kv")
    before = f.read_bytes()
    m.generate(PROMPT + [3, 4, 5], max_tokens=5, ignore_eos=True)

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(session.os, "fsync", boom)
    with pytest.raises(InputError, match="cannot save the conversation"):
        m.save_session(f)
    assert f.read_bytes() == before  # the previous turn's file is intact
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_swap_create_refuses_a_full_disk(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(InputError, match="not enough disk space .* free space or choose a smaller --size"):
        swap.create(tmp_path / "big.swap", free + (1 << 30))
    assert list(tmp_path.iterdir()) == []


def test_swap_create_out_of_space_midway_leaves_nothing(tmp_path, monkeypatch):
    def enospc(fd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(swap.os, "posix_fallocate", enospc)
    with pytest.raises(InputError, match="ran out of space"):
        swap.create(tmp_path / "s.swap", 1 << 20, keep_free=0)
    assert list(tmp_path.iterdir()) == []


def test_bad_swap_files_are_refused(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    good = swap.create(tmp_path / "ok.swap", 4 << 20, keep_free=0)
    with pytest.raises(InputError, match="already exists"):
        swap.create(good, 4 << 20, keep_free=0)
    with pytest.raises(InputError, match="does not exist; create it with: colibri swap create"):
        colibri.load(path, swap=tmp_path / "missing.swap")
    other = tmp_path / "other.swap"
    other.write_bytes(b"\0" * 8192)
    with pytest.raises(InputError, match="not a Colibri swap file"):
        colibri.load(path, swap=other)
    short = tmp_path / "short.swap"
    short.write_bytes(good.read_bytes()[: 1 << 20])
    with pytest.raises(InputError, match="truncated or resized"):
        colibri.load(path, swap=short)
    head = json.loads(good.read_bytes()[len(swap.MAGIC):4096].rstrip(b"\0"))
    assert head["size"] == 4 << 20


def test_a_full_swap_file_is_a_clear_error_and_the_model_stays_usable(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    probe = load(path, tmp_path)
    lay = probe.kv_plan.layout
    small = swap.create(tmp_path / "small.swap", swap.HEADER + 3 * lay.block_bytes, keep_free=0)
    m = load(path, tmp_path, window=12, swap=small)
    with pytest.raises(InputError, match=r"swap file .* is full .*\(colibri swap create --size\)"):
        m.generate(PROMPT, max_tokens=10, ignore_eos=True)
    short = PROMPT[:20]
    assert m.generate(short, max_tokens=5, ignore_eos=True).token_ids == \
        probe.generate(short, max_tokens=5, ignore_eos=True).token_ids


def test_kv_ram_too_small_and_context_overflow(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    m = load(path, tmp_path)
    with pytest.raises(InputError, match="must hold at least 8 .* raise --kv-ram"):
        load(path, tmp_path, kv_ram=m.kv_plan.layout.token_bytes * 5)
    small = load(path, tmp_path, ctx_length=32)
    with pytest.raises(InputError, match="context holds 32"):
        small.generate(list(range(5, 45)), max_tokens=4)


def test_attention_reads_the_blocks_in_place(monkeypatch):
    """A context of several blocks in RAM reaches attention as the blocks themselves (ops.Paged: no copy per layer
    and step), with the values written, and attention over them gives the bits of the assembled context, native
    or torch; q8 blocks too, as codes and scales, dequantized where attention reads them."""
    lay = KVLayout(2, 2, 16, torch.float32, 4)
    k, v = torch.randn(2, 10, 16), torch.randn(2, 10, 16)
    cache = KVCache(lay, 64)
    for i in range(2):
        keys, values = cache.update(i, k, v)
        assert isinstance(keys, ops.Paged) and len(keys.blocks) == 3 and keys.length == 10
        assert torch.equal(keys.dense(), k) and torch.equal(values.dense(), v)
        assert all(b.data_ptr() == t.layers[i][0].data_ptr() for b, t in zip(keys.blocks, cache.table))
        assembled = tuple(t.dense() for t in (keys, values))
        q, pos = torch.randn(4, 3, 16), torch.arange(7, 10)
        assert torch.equal(ops.attend(q, keys, values, pos, None, 0.25, None),
                           ops.attend(q, *assembled, pos, None, 0.25, None))
        with monkeypatch.context() as m:
            m.setattr(ops.kernels, "native", lambda: False)
            assert torch.equal(ops.attend(q, keys, values, pos, 3, 0.25, None),
                               ops.attend(q, *assembled, pos, 3, 0.25, None))
    for dt in (torch.float32, torch.bfloat16):
        q8 = KVCache(KVLayout(2, 2, 32, dt, 4, "q8"), 64)
        got = q8.update(0, torch.randn(2, 10, 32).to(dt), torch.randn(2, 10, 32).to(dt))
        q, pos = torch.randn(4, 3, 32).to(dt), torch.arange(7, 10)
        for n, t in enumerate(got):  # codes and scales where the blocks hold them
            assert isinstance(t, ops.Paged) and t.length == 10 and t.dtype == dt
            assert all(b.data_ptr() == e.layers[0][n].data_ptr() and s.data_ptr() == e.layers[0][n + 2].data_ptr()
                       for b, s, e in zip(t.blocks, t.scales, q8.table))
            want = torch.cat([ops.dequantize_q8(e.layers[0][n], e.layers[0][n + 2], dt) for e in q8.table], 1)
            assert torch.equal(t.dense(), want[:, :10])
        assembled = tuple(t.dense() for t in got)
        assert torch.equal(ops.attend(q, *got, pos, None, 0.25, None), ops.attend(q, *assembled, pos, None, 0.25, None))
        with monkeypatch.context() as m:
            m.setattr(ops.kernels, "native", lambda: False)
            assert torch.equal(ops.attend(q, *got, pos, 3, 0.25, None), ops.attend(q, *assembled, pos, 3, 0.25, None))


@pytest.mark.parametrize("native", [True, False])
def test_room_and_rope_attend_write_what_update_writes(monkeypatch, native):
    """A pass through `room` and ops.rope_attend (the rows written by the attention call) leaves the cache as a pass
    through the biases' add, rope, `update` and attend does and gives the same output bits: passes of 5, 1 (with f32
    biases) and 3 positions (the last across a block boundary) in blocks of 4, f32 and bf16, native or torch; q8
    blocks go through update."""
    if native and not ops.kernels.native():
        pytest.skip("no native kernel tier in this process (COLIBRI_KERNELS=torch, or no compiler)")
    monkeypatch.setattr(ops.kernels, "native", lambda: native)
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():  # as a forward pass runs: the blocks are inference tensors
        _room_passes(gen)
    assert KVCache(KVLayout(2, 2, 32, torch.float32, 4, "q8"), 64).room(0, 1) is None
    idle = KVCache(KVLayout(2, 2, 16, torch.float32, 4), 64)
    with torch.inference_mode():  # a sequence with no rows in a pass: nothing written, nothing attended
        idle.reserve(3)
        idle.advance(3)
        got = ops.rope_attend(torch.zeros(0, 64), torch.zeros(0, 32), torch.zeros(0, 32), torch.zeros(0, 16),
                              torch.zeros(0, 16), *idle.room(0, 0), torch.zeros(0, dtype=torch.long), None, 0.25,
                              None)
    assert got.shape == (0, 64)


def test_rooms_are_every_layers_room_or_none():
    """`rooms` (a pass of all layers in one call) gives each layer's `room`: the same blocks and length; None for q8
    blocks and where a visible block is not in RAM (its rows would be read back a layer at a time)."""
    assert KVCache(KVLayout(3, 2, 32, torch.float32, 4, "q8"), 64).rooms(1) is None
    cache = KVCache(KVLayout(3, 2, 16, torch.float32, 4), 64)
    with torch.inference_mode():
        cache.reserve(6)
        cache.advance(6)
        rooms = cache.rooms(3)
        assert len(rooms) == 3
        for i, pair in enumerate(rooms):
            for got, want in zip(pair, cache.room(i, 3)):
                assert got.length == want.length == 9
                assert [b.data_ptr() for b in got.blocks] == [b.data_ptr() for b in want.blocks]
        cache.table[0].data = None  # as when the block is in the swap file
        assert cache.rooms(1) is None


def _room_passes(gen):
    for dt in (torch.float32, torch.bfloat16):
        lay = KVLayout(2, 2, 16, dt, 4)
        a, b = KVCache(lay, 64), KVCache(lay, 64)
        for T in (5, 1, 3):
            q, k, v = ((torch.randn(T, n * 16, generator=gen) * 2).to(dt) for n in (4, 2, 2))
            cos, sin = (torch.randn(T, 16, generator=gen).to(dt) for _ in range(2))
            bias = [torch.randn(n * 16, generator=gen) for n in (4, 2, 2)] if T == 1 else None  # f32: converted
            pos = torch.arange(a.length, a.length + T)
            for i in range(2):
                qb, kb, vb = (t.clone() for t in (q, k, v))
                for t, bt in zip((qb, kb, vb), bias or ()):
                    ops.add_bias(t, bt)
                qh, kh = (ops.rope(t.view(T, -1, 16).transpose(0, 1), cos, sin) for t in (qb, kb))
                keys, values = a.update(i, kh, vb.view(T, 2, 16).transpose(0, 1))
                want = ops.attend(qh, keys, values, pos, 6, 0.25, None).transpose(0, 1).reshape(T, 64)
                room = b.room(i, T)
                assert isinstance(room[0], ops.Paged) and room[0].length == a.length + T
                assert torch.equal(ops.rope_attend(q, k, v, cos, sin, *room, pos, 6, 0.25, None, bias), want)
                assert all(torch.equal(x.dense(), y.dense() if isinstance(y, ops.Paged) else y)
                           for x, y in zip(room, (keys, values)))
            a.advance(T)
            b.advance(T)


def test_block_tables_hold_one_reference_per_entry(tmp_path):
    """Tables change references only through their pool: a shared entry is copied before a write, a swap_out that
    finds no room leaves the table as it was, and letting go of every table frees every block and slot."""
    lay = KVLayout(2, 1, 32, torch.float32, 4)
    file = swap.create(tmp_path / "t.swap", swap.HEADER + 2 * lay.block_bytes, keep_free=0)
    slots = SwapSlots(lay.num_layers, lay.seg_bytes, lay.block, file)
    pool = BlockPool(lay, slots)
    a, b = pool.table(), pool.table()
    for _ in range(3):
        a.append_new()
    b.append_shared(a[:2])
    assert [x.refs for x in a] == [2, 2, 1] and pool.ram_blocks == 3
    b.make_writable(1)  # b writes its second block: a copy of its own
    assert b[1] is not a[1] and a[1].refs == 1 and pool.ram_blocks == 4
    a.swap_out()  # a alone holds a[1] and a[2]: both to the two slots, a[0] stays for b
    assert a.swapped and a.to_read_back() == 2 and a[0].in_ram and slots.file.used == 2
    a.swap_in()
    assert not a.swapped and slots.file.used == 0
    b.truncate(1)
    b.replace(0, a[1])  # b now holds a[1] in place of a[0]: a alone holds a[0] and a[2]
    assert [x.refs for x in a] == [1, 2, 1] and pool.ram_blocks == 3
    b.release()
    with pytest.raises(InputError, match="is full"):
        a.swap_out()  # three blocks for two slots
    assert not a.swapped and all(x.in_ram for x in a) and slots.file.used == 0
    a.spill_oldest(1)
    assert [x.in_ram for x in a] == [False, False, True] and slots.file.used == 2
    a.release()
    assert pool.ram_blocks == 0 and slots.file.used == 0
    slots.close()


def test_a_swap_directory_that_cannot_be_made_falls_back_or_says_what_to_do(tmp_path, capsys):
    """The default swap directory sits in the cache: where that cannot be written the temporary swap file goes to the
    fallback (the system's temporary directory), with a notice; a directory of the caller's own is an error that
    says what to give instead."""
    lay = KVLayout(2, 1, 32, torch.float32, 4)
    (tmp_path / "afile").write_text("")
    blocked = tmp_path / "afile" / "swap"  # under a file: cannot be made
    elsewhere = tmp_path / "tmp"
    elsewhere.mkdir()
    slots = SwapSlots(lay.num_layers, lay.seg_bytes, lay.block, None, blocked, 2 * lay.block_bytes, fallback=elsewhere)
    opened = slots.file
    assert opened.path.parent == elsewhere
    notice = capsys.readouterr().err.strip()
    assert notice == (f"colibri: the KV swap directory {blocked} cannot be used (Not a directory); the temporary swap"
                      f" file goes to {elsewhere} instead (set COLIBRI_CACHE to a writable directory, or give --swap)")
    opened.close()
    assert not list(elsewhere.glob("*.swap"))  # a temporary file: gone on close
    mine = SwapSlots(lay.num_layers, lay.seg_bytes, lay.block, None, blocked, 2 * lay.block_bytes)
    with pytest.raises(InputError, match=re.escape(f"the swap directory {blocked} cannot be used (Not a directory);"
                                                   " give a writable swap_dir, or a swap file (--swap)")):
        mine.file
