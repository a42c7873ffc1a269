"""Fault injection with fixed seeds: flipped bytes in data pages and manifests, truncations, read errors and full
disks at random points. Every case ends in one clear line (a ColibriError) or in the correct output; never a
hang (each test runs under a watchdog), never a traceback on the CLI, never a file left behind that looks valid."""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import random
import shutil
from pathlib import Path

import pytest

import colibri
import colibri.runtime.model
import tiny_models
from colibri import cli
from colibri.core import atomic
from colibri.convert import pipeline as conv
from colibri.kv import swap
from colibri.core.errors import ColibriError, InputError, ModelLoadError, StorageError
from faults import FailingReads

PROMPT = tiny_models.token_ids(10, 384, seed=5)
TOKENS = 6
CASES = 6  # random cases per kind of fault
WATCHDOG_S = 120  # a test still running after this dumps every thread's stack and exits: a hang fails loudly


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def good(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "c"
    conv.convert(tiny_model_dir("llama"), out, conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))
    return out


@pytest.fixture(scope="module")
def reference(good) -> list[int]:
    with colibri.load(good) as m:
        return m.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids


def limit_of(path: Path) -> int:
    return colibri.runtime.model.plan(path, None)[0].minimum + (96 << 10)  # most pages streamed


def outcome(path: Path, limit=None) -> list[int] | ColibriError:
    """The generated ids, or the ColibriError raised on the way (loading or generating)."""
    try:
        with colibri.load(path, memory_limit=limit) as m:
            return m.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids
    except ColibriError as e:
        assert "\n" not in str(e)
        return e


def damaged(good: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(good, dst)
    return dst


def cli_says_one_line(capsys, *argv: str) -> str:
    """Run the CLI in-process: it must end with a one-line `error:` or succeed, never an internal error."""
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    if rc:
        assert err.strip().splitlines()[-1].startswith("error: "), err
    return err


@pytest.mark.parametrize("seed", range(CASES))
def test_a_flipped_data_byte_is_caught_or_harmless(good, reference, tmp_path, seed, capsys):
    rng = random.Random(seed)
    path = damaged(good, tmp_path, "c")
    data = path / "data-00000.bin"
    at = rng.randrange(data.stat().st_size)
    with open(data, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
    for limit in (None, limit_of(good)):
        got = outcome(path, limit)
        if isinstance(got, ColibriError):
            assert "checksum" in str(got), got
        else:  # only padding between tensors can change without changing a tensor: then nothing differs
            assert got == reference
            assert limit is None, "a streamed page's checksum covers its padding too"
    cli_says_one_line(capsys, "verify", str(path))


@pytest.mark.parametrize("seed", range(CASES))
def test_a_flipped_manifest_byte_is_refused(good, reference, tmp_path, seed, capsys):
    rng = random.Random(100 + seed)
    path = damaged(good, tmp_path, "c")
    mf = path / "manifest.json"
    raw = bytearray(mf.read_bytes())
    at = rng.randrange(len(raw))
    raw[at] ^= 1 << rng.randrange(7)  # stays ASCII: a flip the JSON parser may well accept
    mf.write_bytes(bytes(raw))
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    for limit in (None, limit_of(good)):
        got = outcome(path, limit)
        if parsed is not None and parsed == json.loads((good / "manifest.json").read_text()):
            assert got == reference  # whitespace: the same manifest
        else:
            assert isinstance(got, ModelLoadError), (at, got)
    cli_says_one_line(capsys, "info", "--model", str(path))


@pytest.mark.parametrize("seed", range(CASES))
def test_a_truncated_file_is_refused(good, tmp_path, seed, capsys):
    rng = random.Random(200 + seed)
    path = damaged(good, tmp_path, "c")
    victim = path / rng.choice(["data-00000.bin", "manifest.json", "tokenizer.json" if (path / "tokenizer.json")
                                .exists() else "manifest.json"])
    size = victim.stat().st_size
    os.truncate(victim, rng.randrange(size))
    for limit in (None, limit_of(good)):
        assert isinstance(outcome(path, limit), ModelLoadError)
    cli_says_one_line(capsys, "verify", str(path))


@pytest.mark.parametrize("seed", range(CASES))
def test_read_errors_at_random_reads_fail_one_request(good, reference, seed):
    rng = random.Random(300 + seed)
    with colibri.load(good, memory_limit=limit_of(good), prefetch_depth=rng.randrange(3)) as m:
        m.store.hold()  # the placement's own pins: the rest streams, through the faulty reads
        streamed = m.store.placement.streamed
        page = m.checkpoint.pages[rng.choice(streamed)]
        at = page.offset + rng.randrange(page.nbytes) // 4096 * 4096
        FailingReads(m.store.reader).fail(page.file, at)
        with pytest.raises(StorageError, match="Input/output error"):
            m.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)
        assert m.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids == reference


@pytest.mark.parametrize("seed", range(3))
def test_enospc_at_a_random_conversion_write_leaves_nothing(tiny_model_dir, tmp_path, seed, monkeypatch):
    rng = random.Random(400 + seed)
    real, writes, fail_at = conv._pwrite, [0], rng.randrange(1, 12)

    def full_disk(fd, data, offset):
        writes[0] += 1
        if writes[0] >= fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(conv, "_pwrite", full_disk)
    with pytest.raises(ColibriError, match="no space left"):
        conv.convert(tiny_model_dir("llama"), tmp_path / "c", conv.ConvertOptions(quant="q8", page_size_mb=1))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", range(3))
def test_enospc_at_a_random_swap_write_fails_one_request(tiny_model_dir, tmp_path, seed, monkeypatch):
    rng = random.Random(500 + seed)
    path = tiny_model_dir("llama")
    kw = dict(dtype="float32", kv_block=4, batch_size=8, swap_dir=tmp_path / "swap")
    ref = colibri.load(path, **kw)
    m = colibri.load(path, kv_ram=12 * ref.kv_plan.layout.token_bytes, **kw)
    real, writes, fail_at = os.pwrite, [0], rng.randrange(1, 20)

    def full_disk(fd, data, offset):
        writes[0] += 1
        if writes[0] >= fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    long = list(range(5, 75))
    monkeypatch.setattr(swap.os, "pwrite", full_disk)
    with pytest.raises(StorageError, match="No space left"):
        m.generate(long, max_tokens=10, ignore_eos=True)
    short = long[:7]
    assert m.generate(short, max_tokens=4, ignore_eos=True).token_ids == \
        ref.generate(short, max_tokens=4, ignore_eos=True).token_ids
    monkeypatch.setattr(swap.os, "pwrite", real)  # space is back: the long request runs, with the right tokens
    assert m.generate(long, max_tokens=10, ignore_eos=True).token_ids == \
        ref.generate(long, max_tokens=10, ignore_eos=True).token_ids
    m.close()
    assert list((tmp_path / "swap").iterdir()) == []


@pytest.mark.parametrize("seed", range(3))
def test_enospc_saving_a_session_keeps_the_previous_turn(tiny_model_dir, tmp_path, seed, monkeypatch):
    rng = random.Random(600 + seed)
    m = colibri.load(tiny_model_dir("llama"), dtype="float32", kv_block=4)
    saved = tmp_path / "s.kv"
    m.generate(PROMPT, max_tokens=3, ignore_eos=True)
    m.save_session(saved, [{"role": "user", "content": "one"}])
    before = saved.read_bytes()
    m.generate(PROMPT + [7, 8, 9], max_tokens=3, ignore_eos=True)
    real_open, calls, fail_at = open, [0], rng.randrange(1, 4)

    class FullDisk:  # a file whose writes fail with ENOSPC from the fail_at-th on
        def __init__(self, f):
            self.f = f

        def write(self, data):
            calls[0] += 1
            if calls[0] >= fail_at:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(atomic, "open", lambda *a, **k: FullDisk(real_open(*a, **k)), raising=False)
    with pytest.raises(InputError, match="cannot save the conversation .* No space left"):
        m.save_session(saved, [{"role": "user", "content": "two"}])
    monkeypatch.undo()
    assert saved.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["s.kv"]
    assert m.load_session(saved) == [{"role": "user", "content": "one"}]
