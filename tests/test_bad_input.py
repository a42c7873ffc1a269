"""Bad input: each case is one clear line naming the file/tensor, and nothing is written anywhere."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import clirun
import colibri
from colibri.core.errors import InputError, ModelLoadError, UnsupportedModelError


def snapshot(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*")}


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), dst)
    return dst


def expect(exc, path: Path, *needles: str):
    """Loading `path` raises `exc` with a one-line message containing each needle; the directory is untouched."""
    root = path if path.is_dir() else path.parent
    before = snapshot(root) if root.exists() else {}
    with pytest.raises(exc) as info:
        colibri.load(path)
    msg = str(info.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    assert (snapshot(root) if root.exists() else {}) == before
    return msg


def test_nonexistent_path(tmp_path):
    expect(ModelLoadError, tmp_path / "nope", "no such file", "nope")


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    expect(ModelLoadError, tmp_path / "empty", "config.json")


def test_truncated_safetensors(model_copy):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    expect(ModelLoadError, model_copy, "model.safetensors", "truncated")


def test_garbage_safetensors_header(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    expect(ModelLoadError, model_copy, "model.safetensors")


def test_missing_tensor(model_copy):
    f = model_copy / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, f)
    expect(ModelLoadError, model_copy, "model.layers.1.mlp.down_proj.weight", "missing")


def test_wrong_shape(model_copy):
    f = model_copy / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, f)
    expect(ModelLoadError, model_copy, name, "shape")


def test_unsupported_dtype(model_copy):
    f = model_copy / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, f)
    expect(UnsupportedModelError, model_copy, name, "I8")


def test_unsupported_model_type_lists_supported(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    msg = expect(UnsupportedModelError, model_copy, "gpt_neox", "supported")
    for fam in ("llama", "qwen3_moe", "gemma3", "olmoe"):
        assert fam in msg


def test_corrupt_config_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    expect(ModelLoadError, model_copy, "config.json")


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("hello")
    expect(ModelLoadError, f, "weights.txt")


def test_empty_prompt_and_too_long_prompt(tiny_model_dir):
    m = colibri.load(tiny_model_dir("llama"))
    with pytest.raises(InputError, match="empty prompt"):
        m.generate([])
    with pytest.raises(InputError, match="empty prompt"):
        m.generate("")
    too_long = [1] * (m.context_length + 1)
    with pytest.raises(InputError, match="context holds"):
        m.generate(too_long, max_tokens=1)
    with pytest.raises(InputError, match="outside the vocabulary"):
        m.generate([m.args.vocab_size + 5])
    with pytest.raises(InputError, match="top_p"):
        m.generate([1, 2], top_p=0.0)


def test_cli_errors_are_one_line_without_traceback(tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    p = clirun.run("run", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi", cwd=work)  # a process
    assert p.returncode == 2
    assert p.stderr.strip().startswith("error:") and "missing.gguf" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert list(work.iterdir()) == []
    p = clirun.run("run", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi", "--debug", cwd=work)
    assert "Traceback" in p.stderr


def test_cli_empty_prompt(tiny_model_dir, capsys):
    p = clirun.here(capsys, "run", "--model", str(tiny_model_dir("llama")), "--raw", "--prompt", "")
    assert p.returncode == 2 and "empty prompt" in p.stderr and "Traceback" not in p.stderr
