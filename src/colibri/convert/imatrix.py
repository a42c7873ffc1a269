"""llama.cpp importance matrices for `colibri convert --quant q4_k_m --imatrix FILE`.

An importance matrix holds, per linear weight, the mean of x^2 over calibration tokens for each input channel:
the same statistic `--imatrix builtin` measures (calibrate.py). llama-imatrix writes it in two forms:
* GGUF (its current form): per weight a tensor `<name>.in_sum2` (sums of x^2, [K], or [n_expert, K]) and
  `<name>.counts` (tokens summed, [1] or [n_expert]);
* legacy .dat: int32 entry count, then per entry int32 name length, the name, int32 calls, int32 n and n float32
  values (sums scaled to `calls` calls: the mean is value / calls); trailing fields are ignored.
Names are the GGUF tensor names (`blk.0.attn_v.weight`); `importance` maps them to the model's HF names. A routed
expert's entry ([n_expert, K]) gives each expert its own row.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from colibri.core.errors import InputError, UnsupportedModelError
from colibri.formats.gguf import gguf_tensor_name


def read(path: str | Path) -> dict[str, np.ndarray]:
    """GGUF tensor name -> mean x^2, f32 [K] or [n_expert, K]."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        return _read_gguf(path) if magic == b"GGUF" else _read_dat(path.read_bytes())
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise InputError(f"--imatrix {path}: cannot read it as a llama.cpp importance matrix ({e}); give the .gguf or "
                         ".dat file llama-imatrix wrote, or 'builtin'") from None


def _read_gguf(path: Path) -> dict[str, np.ndarray]:
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".in_sum2") or (c := tensors.get(name[:-len(".in_sum2")] + ".counts")) is None:
            continue
        sums = np.asarray(t.data, dtype=np.float32)
        counts = np.asarray(c.data, dtype=np.float32).reshape(-1)
        sums = sums.reshape(len(counts), -1) if len(counts) > 1 else sums.reshape(-1)
        scale = counts.reshape(-1, 1) if len(counts) > 1 else counts[0]
        out[name[:-len(".in_sum2")]] = np.where(scale > 0, sums / np.maximum(scale, 1), 0).astype(np.float32)
    if not out:
        raise ValueError("no <name>.in_sum2 / <name>.counts tensors")
    return out


def _read_dat(data: bytes) -> dict[str, np.ndarray]:
    (n,), pos, out = struct.unpack_from("<i", data), 4, {}
    if not 0 < n < 1 << 20:
        raise ValueError(f"{n} entries")
    for _ in range(n):
        (length,) = struct.unpack_from("<i", data, pos)
        name = data[pos + 4:pos + 4 + length].decode("utf-8")
        pos += 4 + length
        calls, count = struct.unpack_from("<ii", data, pos)
        pos += 8
        values = np.frombuffer(data, np.float32, count, pos)
        pos += 4 * count
        out[name] = (values / calls if calls > 0 else np.zeros_like(values)).astype(np.float32)
    return out


def importance(table: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]], model_type: str,
               path: str | Path) -> dict[str, torch.Tensor]:
    """HF name -> f32 [K] importance for the matrices in `shapes` that `table` covers (others get none, as
    llama.cpp quantizes a tensor the matrix lacks without importance). Raises InputError when it covers none
    (another model's file)."""
    out = {}
    for name, shape in shapes.items():
        if len(shape) != 2:
            continue
        try:
            gname, expert = gguf_tensor_name(name, model_type)
        except UnsupportedModelError:  # no GGUF counterpart: nothing in the file can be about it
            continue
        v = table.get(gname)
        if v is not None and expert is not None:
            v = v[expert] if v.ndim == 2 and expert < len(v) else None
        if v is not None and v.ndim == 1 and v.size == shape[1]:
            out[name] = torch.from_numpy(v.copy())
    if not out:
        raise InputError(f"--imatrix {path}: none of its {len(table)} entries matches this model's tensors (names "
                         "or sizes); give the importance matrix made for this model")
    return out
