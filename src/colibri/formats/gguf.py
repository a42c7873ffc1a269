"""Read a GGUF file as if it were a HF checkpoint: a config.json-style dict, HF tensor names and
layouts, float32 tensors dequantized one at a time.

The file is memory-mapped by `gguf.GGUFReader`; opening reads only the metadata and tensor table.
Three things differ from a HF checkpoint besides names (all undone in `load`):

* llama.cpp's converter permutes the rows of q/k projections of `llama`-arch models (and their
  biases) from HF's rotate-half rope layout to the interleaved one it computes with.
* Gemma's RMSNorm computes `x * (1 + w)`; the converter stores `1 + w` so llama.cpp can use `x * w`.
* MoE expert weights are fused into one 3-D tensor per projection, `[n_expert, out, in]`.

Configuration comes only from the metadata (`{arch}.*` keys) and the tensor table; values that
llama.cpp hard-codes for an architecture (Gemma 3's sliding-window pattern and local rope base)
are hard-coded here the same way.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from colibri.core.errors import ModelLoadError, UnsupportedModelError, out_of_memory
from colibri.formats.gguf_tokenizer import special_tokens, tokenizer_from_gguf

# GGUF `general.architecture` -> HF `model_type` (mixtral is arch "llama" with experts).
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "gemma3": "gemma3_text",
}
# Float and block types that `gguf.quants.dequantize` turns into float32.
SUPPORTED_TYPES = {QT.F32, QT.F16} | {
    getattr(QT, n) for n in (
        "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0",
        "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "MXFP4",
    ) if hasattr(QT, n)
}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# `blk.{i}.<key>` -> `model.layers.{i}.<value>`
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 3 norms around both sublayers ("sandwich" norm).
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_MIXTRAL_LAYER_NAMES = _LAYER_NAMES | {"ffn_gate_inp": "block_sparse_moe.gate"}
def _layer_names(model_type: str) -> dict[str, str]:
    """`blk.{i}.<key>` -> `model.layers.{i}.<value>` for a model_type."""
    return {"gemma3_text": _GEMMA3_LAYER_NAMES, "mixtral": _MIXTRAL_LAYER_NAMES}.get(model_type, _LAYER_NAMES)


_EXPERT_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MIXTRAL_EXPERT_PROJ = {"gate": "w1", "down": "w2", "up": "w3"}
# llama.cpp-only tensors with no HF counterpart that change the math: refuse rather than drop.
_UNSUPPORTED_TENSORS = {"rope_freqs": "llama3-style rope frequency factors (rope_freqs.weight)"}

_BLK = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")
_EXPS = re.compile(r"ffn_(gate|up|down)_exps$")
_REQUIRED = object()


@dataclass(frozen=True)
class _Source:
    """Where one HF tensor lives in the file and what to do to it."""

    gguf_name: str
    expert: int | None = None  # index into a fused `[n_expert, out, in]` tensor
    heads: int | None = None  # undo llama.cpp's rope row permutation for this many heads
    minus_one: bool = False  # Gemma norm stored as 1 + w
    shape: tuple[int, ...] | None = None  # HF shape when it differs from the file's


class GGUFCheckpoint:
    """A GGUF file opened lazily (loaders.checkpoint.Checkpoint): metadata parsed, tensors read and dequantized
    on `load`; `raw_tensor` gives the stored blocks."""

    format = "gguf"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._reader = open_reader(self.path)
        self.metadata: dict[str, Any] = {k: _field_value(f) for k, f in self._reader.fields.items()}
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.arch: str = self.metadata.get("general.architecture", "")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        self._check_types()
        self.config: dict[str, Any] = self._build_config()
        self._sources: dict[str, _Source] = self._map_tensors()
        self.special: dict[str, Any] = special_tokens(self.metadata) if "tokenizer.ggml.tokens" in self.metadata else {}
        self.chat_template: str | None = self.metadata.get("tokenizer.chat_template")

    # ---- public surface -------------------------------------------------------------------------

    @cached_property
    def tokenizer(self):
        """The file's own tokenizer as a `tokenizers.Tokenizer` (built on first use: seconds for 256k vocabularies),
        or None when the file embeds none (the model then runs on token ids only)."""
        if "tokenizer.ggml.tokens" not in self.metadata:
            return None
        return tokenizer_from_gguf(self.metadata)

    def tensor_names(self) -> list[str]:
        return list(self._sources)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        src = self._source(name)
        if src.shape is not None:
            return src.shape
        return _hf_shape(self._tensors[src.gguf_name], src.expert)

    def tensor_dtype(self, name: str) -> str:
        """Storage type as GGUF names it (Q4_1, Q6_K, F32, ...)."""
        return self._tensors[self._source(name).gguf_name].tensor_type.name

    def default_dtype(self) -> torch.dtype:
        """f32: every tensor is dequantized to f32 at load."""
        return torch.float32

    def load(self, name: str) -> torch.Tensor:
        """Tensor `name` (HF naming and layout) as a new float32 tensor."""
        src = self._source(name)
        t = self._tensors[src.gguf_name]
        data = t.data if src.expert is None else t.data[src.expert]
        w = _dequantize_rows(data, t.tensor_type).reshape(self.tensor_shape(name))
        if src.heads is not None:
            w = _unpermute_rows(w, src.heads)
        self._drop_pages(t)
        out = torch.from_numpy(w)
        if src.minus_one:
            out -= 1.0
        return out

    def stored_nbytes(self, name: str) -> int:
        """Bytes the file stores for tensor `name` (one expert's share of a fused expert tensor)."""
        src = self._source(name)
        t = self._tensors[src.gguf_name]
        return int(t.n_bytes) // (int(t.data.shape[0]) if src.expert is not None else 1)

    def load_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` as float32, dequantizing only those (the whole tensor is read for
        the tensors whose rows the file keeps in another order: rope-permuted projections, Gemma norms)."""
        src = self._source(name)
        if src.heads is not None or src.minus_one:
            return self.load(name)[start:stop]
        t = self._tensors[src.gguf_name]
        data = t.data if src.expert is None else t.data[src.expert]
        rows = _dequantize_rows(data[start:stop], t.tensor_type)
        return torch.from_numpy(rows.reshape(-1, *self.tensor_shape(name)[1:]))

    def raw_tensor(self, name: str, copy: bool = True) -> tuple[QT, np.ndarray, tuple[int, ...]]:
        """`(ggml type, stored data, HF shape)` without dequantizing, for lossless re-export.

        Block types come back as uint8 `[rows, bytes_per_row]` (`[out, bytes]` for one expert), rows
        already in HF order (permuting whole rows of blocks is lossless). A tensor whose values must
        change (Gemma norms) comes back as its float32 `load` result, typed F32. `copy=False`: where the rows are
        stored in order, a view of the file's map (read as it is used; `release(name)` afterwards lets its pages
        go), so a large tensor is never held twice.
        """
        src = self._source(name)
        if src.minus_one:
            return QT.F32, self.load(name).numpy(), self.tensor_shape(name)
        t = self._tensors[src.gguf_name]
        data = t.data if src.expert is None else t.data[src.expert]
        if src.heads is not None:
            data = _unpermute_rows(data, src.heads)
        elif copy:
            data = np.array(data)
        else:
            return QT(t.tensor_type), data, self.tensor_shape(name)
        self._drop_pages(t)
        return QT(t.tensor_type), data, self.tensor_shape(name)

    def release(self, name: str) -> None:
        """Let the map's pages of tensor `name` go (after reading a view of it)."""
        self._drop_pages(self._tensors[self._source(name).gguf_name])

    def _drop_pages(self, t) -> None:
        """Unmap the pages of a tensor just read, so converting a large file keeps RSS at about one tensor (the
        kernel keeps them in the page cache; only this process's mapping lets go)."""
        mm = self._reader.mmap
        if mm is None:
            return
        start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(t.data_offset + t.n_bytes, len(mm))
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def write_metadata(self, path: Path) -> None:
        """Every key-value of the file (architecture, hyperparameters, tokenizer, chat template), with its own GGUF
        type, into a GGUF at `path` holding no tensors: what an export needs to write a file llama.cpp loads."""
        w = GGUFWriter(path, self.arch)
        copy_metadata(self._reader, w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    def close(self) -> None:
        """Drop the memory map (released once no loaded view refers to it)."""
        self._reader = None
        self._tensors = {}

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- config ---------------------------------------------------------------------------------

    def _key(self, name: str, default: Any = _REQUIRED) -> Any:
        key = f"{self.arch}.{name}"
        if key in self.metadata:
            return self.metadata[key]
        if default is _REQUIRED:
            raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing; the file is incomplete")
        return default

    def _build_config(self) -> dict[str, Any]:
        arch, key, meta = self.arch, self._key, self.metadata
        hidden, heads = key("embedding_length"), key("attention.head_count")
        n_experts = key("expert_count", 0)
        model_type = "mixtral" if arch == "llama" and n_experts else ARCHITECTURES[arch]
        tokens = meta.get("tokenizer.ggml.tokens")
        embd = self._tensors.get("token_embd.weight")
        vocab = len(tokens) if tokens is not None else (int(embd.shape[-1]) if embd is not None else None)
        head_dim = key("attention.key_length", None)
        if head_dim is None:
            # llama writes the rotary width, which is the head size there; others imply hidden/heads
            head_dim = key("rope.dimension_count", None) if arch == "llama" else None
        head_dim = head_dim or hidden // heads
        cfg: dict[str, Any] = {
            "model_type": model_type,
            "vocab_size": key("vocab_size", vocab),
            "hidden_size": hidden,
            "intermediate_size": key("feed_forward_length", None),
            "num_hidden_layers": key("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": key("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
            "rope_theta": key("rope.freq_base", 10000.0),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": key("context_length"),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "sliding_window": key("attention.sliding_window", None),
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        }
        if n_experts:
            cfg["num_experts_per_tok"] = key("expert_used_count")
            cfg["num_local_experts" if model_type == "mixtral" else "num_experts"] = n_experts
            expert_ffn = key("expert_feed_forward_length", None)
            if model_type in ("qwen2_moe", "qwen3_moe"):
                cfg["moe_intermediate_size"] = expert_ffn or cfg["intermediate_size"]
                cfg["decoder_sparse_step"], cfg["mlp_only_layers"] = 1, []
                # llama.cpp renormalizes the top-k weights for qwen3moe, not for qwen2moe
                cfg["norm_topk_prob"] = model_type == "qwen3_moe"
            elif expert_ffn:
                cfg["intermediate_size"] = expert_ffn
            if model_type == "qwen2_moe":
                cfg["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length")
            if model_type == "olmoe":
                cfg["norm_topk_prob"] = False
                cfg["clip_qkv"] = key("attention.clamp_kqv", None)
        if model_type == "qwen2":
            cfg["attention_bias"] = True
            cfg["use_sliding_window"] = False
        if model_type == "gemma3_text":
            self._gemma3_config(cfg)
        cfg["rope_parameters"] = self._rope_parameters(cfg)
        return cfg

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._key("rope.scaling.type", None)
        if kind in (None, "none"):
            return None
        out: dict[str, Any] = {"rope_type": kind, "factor": float(self._key("rope.scaling.factor"))}
        orig = self._key("rope.scaling.original_context_length", None)
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        attn = self._key("rope.scaling.attn_factor", None)
        if attn is not None:
            out["attention_factor"] = float(attn)
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (v := self._key(f"rope.scaling.{gguf_name}", None)) is not None:
                out[hf_name] = float(v)
        return out

    def _gemma3_config(self, cfg: dict[str, Any]) -> None:
        key = self._key
        # llama.cpp hard-codes every 6th layer global and 10k rope base for the local ones.
        pattern = key("attention.sliding_window_pattern", 6)
        n = cfg["num_hidden_layers"]
        cfg["sliding_window_pattern"] = cfg["_sliding_window_pattern"] = pattern
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
        cfg["rope_local_base_freq"] = 10000.0
        del cfg["hidden_act"]
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        # Only the 27B scales queries by hidden/heads (llama.cpp keys this off the layer count).
        cfg["query_pre_attn_scalar"] = (
            cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
        )
        cfg["final_logit_softcapping"] = key("final_logit_softcapping", None)
        cfg["attn_logit_softcapping"] = key("attn_logit_softcapping", None)
        cfg["use_bidirectional_attention"] = False

    def _rope_parameters(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """The same rope settings in transformers 5's `rope_parameters` form."""
        full = {"rope_type": "default", "rope_theta": cfg["rope_theta"]} | (cfg["rope_scaling"] or {})
        if cfg["model_type"] == "gemma3_text":
            local = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
            return {"full_attention": full, "sliding_attention": local}
        return full

    # ---- tensors --------------------------------------------------------------------------------

    def _check_types(self) -> None:
        size = os.path.getsize(self.path)
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name} ends past the end of the file; the file is truncated, "
                    "download it again"
                )
            if t.tensor_type not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name} has quantization {QT(t.tensor_type).name}, which is not "
                    f"supported; supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))}"
                )

    def _map_tensors(self) -> dict[str, _Source]:
        cfg = self.config
        mt = cfg["model_type"]
        layer_names = _layer_names(mt)
        gemma = mt == "gemma3_text"
        out: dict[str, _Source] = {}
        for gname, t in self._tensors.items():
            base, _, suffix = gname.rpartition(".")
            if base in _UNSUPPORTED_TENSORS:
                raise UnsupportedModelError(f"{self.path}: {_UNSUPPORTED_TENSORS[base]} are not supported yet")
            minus_one = gemma and gname.endswith("norm.weight")
            if base in _GLOBAL_NAMES:
                out[f"{_GLOBAL_NAMES[base]}.{suffix}"] = _Source(gname, minus_one=minus_one)
                continue
            m = _BLK.match(gname)
            if m is None:
                raise UnsupportedModelError(f"{self.path}: unexpected tensor {gname!r} for architecture {self.arch}")
            layer, kind, expert, suffix = m.groups()
            prefix = f"model.layers.{layer}."
            if (e := _EXPS.match(kind)) is not None:
                for i in range(t.data.shape[0]):
                    out[prefix + self._expert_name(e.group(1), i) + "." + suffix] = _Source(gname, expert=i)
                continue
            if expert is not None and (e := re.fullmatch(r"ffn_(gate|up|down)", kind)) is not None:
                # older per-expert layout: blk.{i}.ffn_gate.{e}.weight
                out[prefix + self._expert_name(e.group(1), int(expert)) + "." + suffix] = _Source(gname)
                continue
            if kind not in layer_names or expert is not None:
                raise UnsupportedModelError(f"{self.path}: unexpected tensor {gname!r} for architecture {self.arch}")
            heads = None
            if self.arch == "llama" and kind in ("attn_q", "attn_k"):
                heads = cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]
            shape = (1, cfg["hidden_size"]) if kind == "ffn_gate_inp_shexp" else None
            src = _Source(gname, heads=heads, minus_one=minus_one, shape=shape)
            out[prefix + layer_names[kind] + "." + suffix] = src
        return out

    def _expert_name(self, proj: str, i: int) -> str:
        if self.config["model_type"] == "mixtral":
            return f"block_sparse_moe.experts.{i}.{_MIXTRAL_EXPERT_PROJ[proj]}"
        return f"mlp.experts.{i}.{_EXPERT_PROJ[proj]}"

    def _source(self, name: str) -> _Source:
        if self._reader is None:
            raise ModelLoadError(f"{self.path}: the checkpoint is closed; open it again to load tensors")
        try:
            return self._sources[name]
        except KeyError:
            raise ModelLoadError(
                f"{self.path}: no tensor {name!r} in this GGUF checkpoint; see tensor_names() for what it holds"
            ) from None


class _Reader(GGUFReader):
    """gguf's reader over the map as a plain ndarray: it slices the file once per metadata value (each string of
    a tokenizer's vocabulary and merges: ~250k slices for a 49k-token vocabulary), and numpy.memmap's slicing
    runs Python hooks (__getitem__, __array_finalize__) on each, most of the open's time. The same bytes, fields
    and tensor views; `mmap` is the mapping (for madvise), None where numpy kept none."""

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, v: np.ndarray) -> None:  # the reader's __init__ assigns its np.memmap here first
        self.mmap = getattr(v, "_mmap", None)
        self._array = v.view(np.ndarray)


def open_reader(path: Path) -> GGUFReader:
    """A reader of the GGUF at `path` (metadata parsed, tensors mapped), or ModelLoadError naming what is wrong."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file; check the path")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); pass a .gguf file")
    try:
        return _Reader(path)
    except Exception as e:  # the reader fails in many obscure ways on a short or damaged file
        if out_of_memory(e):  # not the file's fault: the CLI says so
            raise
        raise ModelLoadError(
            f"{path}: the GGUF file is truncated or corrupt ({type(e).__name__}: {_first_line(e)}); download it again"
        ) from e


DEQUANT_ROWS_BYTES = 8 << 20  # stored bytes dequantized per step: numpy's dequantizers make several f32 temporaries


def _dequantize_rows(data: np.ndarray, qtype) -> np.ndarray:
    """float32 copy of a stored tensor, dequantized a few MiB of rows at a time (bounded temporaries)."""
    if qtype == QT.F32:
        return np.array(data, dtype=np.float32)  # a view of the map: copy it
    if data.ndim < 2 or data.shape[0] < 2:
        return dequantize(data, qtype).astype(np.float32, copy=False)
    step = max(1, DEQUANT_ROWS_BYTES // max(1, data[0].nbytes))
    first = dequantize(data[:step], qtype)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    out[:step] = first
    for r in range(step, data.shape[0], step):
        out[r:r + step] = dequantize(data[r:r + step], qtype)
    return out


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def _field_value(field) -> Any:
    """A metadata field as a Python value (arrays as lists, strings decoded as UTF-8)."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if len(types) > 1 and types[1] == GGUFValueType.ARRAY:
            return None  # nested arrays: nothing we read uses them
        return [field.parts[i][0].item() for i in field.data] if field.data else []
    part = field.parts[field.data[0]]
    if types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    if types[0] == GGUFValueType.BOOL:
        return bool(part[0])
    return part[0].item()


# Keys a GGUFWriter writes itself: the architecture, and the data alignment it pads the file to.
_WRITER_KEYS = ("general.architecture", "general.alignment")


def copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Add every key-value of `reader`'s file to `writer`, each with its own GGUF type (not the header's virtual
    `GGUF.*` fields, nor the keys the writer writes itself)."""
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in _WRITER_KEYS:
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)


_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def gguf_tensor_name(name: str, model_type: str) -> tuple[str, int | None]:
    """Where HF tensor `name` of a `model_type` model goes in a GGUF (the inverse of the names `load` reads): the
    GGUF tensor's name, and for an expert's projection its index in the fused `[n_expert, out, in]` tensor."""
    for gguf_base, hf in _GLOBAL_NAMES.items():
        if name.startswith(hf + "."):
            return gguf_base + name[len(hf):], None
    if (m := _HF_EXPERT.fullmatch(name)) is not None:
        proj = _MIXTRAL_EXPERT_PROJ if model_type == "mixtral" else _EXPERT_PROJ
        kind = next((k for k, v in proj.items() if v == m.group(3)), None)
        if kind is not None:
            return f"blk.{m.group(1)}.ffn_{kind}_exps.weight", int(m.group(2))
    layer_names = _layer_names(model_type)
    m = _HF_LAYER.fullmatch(name)
    kind = next((k for k, v in layer_names.items() if m and v == m.group(2)), None)
    if kind is None:
        raise UnsupportedModelError(f"tensor {name!r} has no GGUF name in a {model_type} model")
    return f"blk.{m.group(1)}.{kind}.{m.group(3)}", None


def gguf_tensor_shape(gguf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The GGUF shape (numpy order) of a tensor whose HF shape is `shape` (a shared-expert gate is 1-D there)."""
    return shape[1:] if re.search(r"\.ffn_gate_inp_shexp\.", gguf_name) else shape


def rope_permuted_heads(name: str, config: dict[str, Any]) -> int | None:
    """For the q/k projections (and biases) of a llama-arch model: the head count whose rows llama.cpp stores
    permuted (see _unpermute_rows); else None."""
    if config.get("model_type") not in ("llama", "mixtral"):  # GGUF architecture "llama"
        return None
    if ".self_attn.q_proj." in name:
        return config["num_attention_heads"]
    if ".self_attn.k_proj." in name:
        return config["num_key_value_heads"]
    return None


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (the inverse of _unpermute_rows): HF's rotary halves interleaved per head."""
    half = w.shape[0] // heads // 2
    return np.ascontiguousarray(w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _hf_shape(t, expert: int | None) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first; HF/numpy slowest-first.
    shape = tuple(int(d) for d in reversed(t.shape))
    return shape[1:] if expert is not None else shape


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp stores, per head, rows interleaved as (x0, x_{d/2}, x1, x_{d/2+1}, ...); HF keeps the
    two rotary halves contiguous. w: [heads * d, ...] (weights, biases, or rows of raw blocks).
    """
    half = w.shape[0] // heads // 2
    return np.ascontiguousarray(w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))
