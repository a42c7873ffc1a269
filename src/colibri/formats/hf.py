"""HuggingFace checkpoint directories: config.json, single or sharded safetensors, tokenizer and generation files."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from colibri.core.errors import ModelLoadError, UnsupportedModelError

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
FLOAT_DTYPES = set(SAFETENSORS_DTYPES)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e}); re-download or fix the file") from None


def safetensors_header(path: Path) -> tuple[dict, int]:
    """Parse and bounds-check a .safetensors header: ({name: {dtype, shape, data_offsets}}, data start)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"{path}: truncated safetensors file (no header); re-download it")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100 * 2**20:
            raise ModelLoadError(f"{path}: truncated or corrupt safetensors header; re-download it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelLoadError(f"{path}: corrupt safetensors header; re-download it") from None
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in header.items():
        end = info["data_offsets"][1]
        if end > data_size:
            raise ModelLoadError(
                f"{path}: truncated: tensor {name!r} ends at byte {end} but the file holds {data_size} data bytes;"
                " re-download the file")
    return header, 8 + n


class HFCheckpoint:
    """An HF model directory (loaders.checkpoint.Checkpoint): config.json, safetensors, tokenizer files."""

    format = "huggingface"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{self.path}: no config.json; point --model at a HuggingFace model directory,"
                                 " a .gguf file, or a converted Colibri container")
        self.config = read_json(cfg_path)
        gen = self.path / "generation_config.json"
        self.generation_config = read_json(gen) if gen.is_file() else {}
        self._index = self._tensor_index()
        self._handles: dict[Path, int] = {}
        self.tokenizer, self.chat_template, self.special = self._tokenizer_files()

    def _tensor_index(self) -> dict[str, tuple[Path, dict]]:
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = read_json(index_file).get("weight_map", {})
            files = sorted({self.path / f for f in weight_map.values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
                raise ModelLoadError(f"{self.path}: only PyTorch .bin weights found; save the model as safetensors"
                                     " (save_pretrained(..., safe_serialization=True))")
            raise ModelLoadError(f"{self.path}: no .safetensors weights found")
        index = {}
        self._data_start: dict[Path, int] = {}
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: listed in model.safetensors.index.json but missing; re-download it")
            header, self._data_start[f] = safetensors_header(f)
            for name, info in header.items():
                index[name] = (f, info)
        return index

    def tensor_names(self) -> list[str]:
        return list(self._index)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._index[name][1]["shape"])

    def tensor_dtype(self, name: str) -> str:
        return self._index[name][1]["dtype"]

    def default_dtype(self) -> torch.dtype:
        """bf16 for weights stored in bf16/f16 (memory as on disk), else f32."""
        name = self.config.get("torch_dtype") or self.config.get("dtype")
        return torch.bfloat16 if name in ("bfloat16", "float16") else torch.float32

    def load(self, name: str) -> torch.Tensor:
        if name not in self._index:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        f, info = self._index[name]
        if info["dtype"] not in FLOAT_DTYPES:
            raise UnsupportedModelError(f"{f}: tensor {name!r} has dtype {info['dtype']}; supported: F32, F16, BF16"
                                        " (convert quantized checkpoints with their own tools first)")
        # pread into a fresh buffer rather than safetensors' mmap: touched mmap pages count as RSS, so converting
        # a 14 GB checkpoint through the map would grow RSS to 14 GB; this keeps it at about one tensor.
        if f not in self._handles:
            self._handles[f] = os.open(f, os.O_RDONLY)
        start, end = info["data_offsets"]
        buf = torch.empty(end - start, dtype=torch.uint8)
        if end > start:
            got = os.preadv(self._handles[f], [memoryview(buf.numpy())], self._data_start[f] + start)
            if got != end - start:
                raise ModelLoadError(f"{f}: short read of tensor {name!r}; the file is truncated, re-download it")
        return buf.view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])

    def _tokenizer_files(self):
        tok_file = self.path / "tokenizer.json"
        tokenizer = None
        if tok_file.is_file():
            from tokenizers import Tokenizer
            try:
                tokenizer = Tokenizer.from_file(str(tok_file))
            except Exception as e:
                raise ModelLoadError(f"{tok_file}: cannot be read by tokenizers ({e})") from None
        tcfg_file = self.path / "tokenizer_config.json"
        tcfg = read_json(tcfg_file) if tcfg_file.is_file() else {}
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")

        def token_str(v):
            return v.get("content") if isinstance(v, dict) else v

        special = {k: token_str(tcfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos = self.generation_config.get("eos_token_id", self.config.get("eos_token_id"))
        special["eos_token_id"] = eos
        special["bos_token_id"] = self.generation_config.get("bos_token_id", self.config.get("bos_token_id"))
        return tokenizer, template, special

    def close(self) -> None:
        for fd in self._handles.values():
            os.close(fd)
        self._handles.clear()
