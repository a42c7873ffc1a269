"""Issue 26 item 2: models by name. `colibri list` / `colibri rm` over the containers under the managed cache, and
`--model` as a listed name or a Hugging Face hub id resolved through a hub cache the tests fill themselves
(HF_HUB_OFFLINE=1: nothing here reaches the network)."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import real_models
from clirun import here
from colibri.convert import managed
from colibri.convert import pipeline as conv

WORDS = [f"w{i}" for i in range(300)]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
RUN = ["run", "--raw", "--json", "-n", "3", "-t", "1", "-c", "64", "w5 w6 w7"]


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """A managed cache and a hub cache of this test's own, offline."""
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "colibri"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


@pytest.fixture(scope="module")
def tiny_src(tiny_model_dir, tmp_path_factory):
    """A tiny llama with a word-level tokenizer: an HF directory that runs with a text prompt."""
    src = tmp_path_factory.mktemp("byname") / "tiny"
    shutil.copytree(tiny_model_dir("llama"), src)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(src / "tokenizer.json"))
    return src


def hub_snapshot(cache, repo: str, files: dict) -> object:
    """Lay out `files` (name -> source path) as huggingface_hub's cache holds a downloaded snapshot of `repo`:
    blobs, snapshots/COMMIT/NAME linking to them, refs/main naming the commit."""
    d = cache / "hub" / ("models--" + repo.replace("/", "--"))
    snap = d / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (d / "blobs").mkdir()
    for name, src in files.items():
        blob = d / "blobs" / f"blob-{name}"
        blob.symlink_to(src) if src.stat().st_size > 2**20 else shutil.copyfile(src, blob)
        (snap / name).symlink_to(blob)
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(COMMIT)
    return snap


def test_list_run_by_name_and_rm(caches, tiny_src, capsys):
    direct = here(capsys, *RUN, "-m", str(tiny_src))
    assert direct.returncode == 0, direct.stderr
    r = here(capsys, "list")
    assert r.returncode == 0 and r.stdout == "" and "no models in" in r.stderr
    conv.convert(tiny_src, managed.models_root() / "tiny-f32", conv.ConvertOptions(quant="f32"))
    r = here(capsys, "list")
    header, row = r.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "KINDS", "CREATED", "VERIFIED", "SOURCE"]
    assert row.startswith("tiny-f32 ") and row.endswith(str(tiny_src.resolve())) and " f32 " in row
    assert " never " in row
    (entry,) = [json.loads(x) for x in here(capsys, "list", "--json").stdout.splitlines()]
    assert entry["name"] == "tiny-f32" and entry["kinds"] == ["f32"] and entry["source"] == str(tiny_src.resolve())
    assert entry["verified"] is None
    r = here(capsys, "verify", "-m", "tiny-f32")  # by name; a full check records when
    assert r.returncode == 0 and r.stdout.startswith("ok:"), r.stderr
    (entry,) = [json.loads(x) for x in here(capsys, "list", "--json").stdout.splitlines()]
    assert entry["verified"] >= entry["created"] and " never " not in here(capsys, "list").stdout
    assert entry["size"] == sum(f.stat().st_size for f in (managed.models_root() / "tiny-f32").iterdir())
    by_name = here(capsys, *RUN, "-m", "tiny-f32")  # f32: the same tokens as the HF directory
    assert by_name.returncode == 0, by_name.stderr
    assert json.loads(by_name.stdout)["token_ids"] == json.loads(direct.stdout)["token_ids"]
    r = here(capsys, "doctor", "-m", "tiny-f32", "--json", "--probe-seconds", "0.1")  # names work in every command
    assert "not found" not in r.stdout and "tiny-f32" in r.stdout, r.stdout + r.stderr
    r = here(capsys, "rm", "tiny-f32")
    assert r.returncode == 0 and "removed" in r.stderr and not (managed.models_root() / "tiny-f32").exists()
    for name in ("tiny-f32", "../colibri", ""):
        r = here(capsys, "rm", name)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no managed model named" in r.stderr, r.stderr


def test_hub_ids_resolve_through_the_hub_cache_offline(caches, tiny_src, capsys):
    files = {f.name: f for f in tiny_src.iterdir() if f.is_file()}
    snap = hub_snapshot(caches, "someorg/tiny-llama", files)
    direct = here(capsys, *RUN, "-m", str(tiny_src))
    by_id = here(capsys, *RUN, "-m", "someorg/tiny-llama")
    assert by_id.returncode == 0, by_id.stderr
    assert json.loads(by_id.stdout)["token_ids"] == json.loads(direct.stdout)["token_ids"]
    assert managed.resolve("someorg/tiny-llama") == str(snap)
    # a container converted from the hub snapshot remembers it, and the list names it by its hub id
    conv.convert(snap, managed.models_root() / "tiny", conv.ConvertOptions(quant="f32"))
    assert [m.source for m in managed.listed()] == ["someorg/tiny-llama"]
    # offline with nothing cached: one line naming the id
    r = here(capsys, *RUN, "-m", "someorg/not-cached")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "someorg/not-cached" in r.stderr and "HF_HUB_OFFLINE" in r.stderr and "Traceback" not in r.stderr
    # a GGUF repository without a quantization named: the error says how to name one
    gguf = real_models.smollm2_gguf()
    if gguf is None:
        return
    hub_snapshot(caches, "someorg/smol-GGUF", {"smollm2-135m-instruct-q4_1.gguf": gguf})
    r = here(capsys, "info", "-m", "someorg/smol-GGUF")
    assert r.returncode == 2 and "someorg/smol-GGUF:Q4_K_M" in r.stderr, r.stderr
    path = managed.resolve("someorg/smol-GGUF:Q4_1")  # the file's name spells it in lower case
    assert path.endswith("smollm2-135m-instruct-q4_1.gguf")
    r = here(capsys, "info", "-m", "someorg/smol-GGUF:Q4_1")
    assert r.returncode == 0 and "llama" in r.stdout, r.stderr
    r = here(capsys, "info", "-m", "someorg/smol-GGUF:Q8_0")
    assert r.returncode == 2 and "0 GGUF files of someorg/smol-GGUF match Q8_0" in r.stderr, r.stderr


def test_a_gguf_runs_from_its_container_in_the_managed_cache(caches, tmp_path, capsys):
    """`--model x.gguf` converts the file into the managed cache once (exact kinds kept), says so, and runs the
    container; the next start finds it (nothing converted again) and `colibri list` names its source."""
    from test_export import tiny_gguf
    from gguf import GGMLQuantizationType as QT

    src = tiny_gguf(tmp_path / "tiny.gguf", QT.Q4_K)
    first = here(capsys, "run", "-m", str(src), "--raw", "-n", "3", "-t", "1", "-c", "64", "hello")
    assert first.returncode == 0, first.stderr
    assert "first use" in first.stderr
    [entry] = [m for m in managed.listed() if m.source == str(src)]
    assert entry.name.startswith("tiny-q4-") and "q4k" in entry.kinds
    again = here(capsys, "run", "-m", str(src), "--raw", "-n", "3", "-t", "1", "-c", "64", "hello")
    assert again.returncode == 0 and "first use" not in again.stderr and again.stdout == first.stdout
