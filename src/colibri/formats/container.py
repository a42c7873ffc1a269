"""The Colibri container (docs/format.md): layout planning shared by the writer, and the reader.

`plan_layout` decides, before a byte is written, where every tensor and page goes; the converter fills it in and
the reader trusts nothing but the manifest it produced.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import zlib
from dataclasses import MISSING, dataclass, fields
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

import numpy as np
import torch

from colibri.quant import kinds as quant
from colibri.core.errors import ModelLoadError, UnsupportedModelError

FORMAT = "colibri-container"
# Version 3: the manifest's own checksum and the checksums of the tokenizer and chat template files are required,
# so damage cannot switch a check off by renaming its key. Version 4: version 3 with q4k's scale codes packed (12
# bits a group and row, GGUF Q4_K's size; colibri.quant.kinds), written only for a container that holds a q4k
# tensor (else 3), so an older Colibri refuses by version what it would misread. Version 5: q4k's scale codes and
# super-scales written a tile of its codes after the other (a tile's pass reads them as one run of bytes), again
# only where a q4k tensor is. Versions 1 (no K-quant kinds) and 2 (K-quant kinds) are still read; their checks
# apply where the field is present.
VERSION = 5
READS = (1, 2, 3, 4, 5)
ALIGN = 4096
PART_ALIGN = 64
MANIFEST = "manifest.json"
# A container converted from a GGUF keeps the file's metadata (every key-value, no tensors) beside the manifest:
# what `colibri convert --output model.gguf` writes back. Optional: older containers have none.
GGUF_METADATA = "gguf_metadata.gguf"
FLOAT_KINDS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
QUANT_KINDS = quant.QUANT_KINDS_ALL
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
          "int8": torch.int8, "int32": torch.int32}


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def crc32(data, value: int = 0) -> int:
    return zlib.crc32(memoryview(data).cast("B"), value)


def checksum_str(value: int) -> str:
    return f"crc32:{value:08x}"


CRC_STEP = 16 << 20  # bytes read per step when checksumming a range of a file (a page may be gigabytes)


def range_checksum(read: Callable[[int, int], Any], offset: int, nbytes: int) -> str:
    """The checksum of nbytes from offset, read(offset, n) giving the bytes a CRC_STEP at a time."""
    crc = 0
    for o in range(offset, offset + nbytes, CRC_STEP):
        crc = crc32(read(o, min(CRC_STEP, offset + nbytes - o)), crc)
    return checksum_str(crc)


class Record:
    """A manifest record, read by attribute (`entry.kind`, `entry.group_size`); its manifest JSON is
    `dataclasses.asdict` of it."""

    @classmethod
    def from_json(cls, d: dict) -> Any:
        """The record as the writer made it, from its manifest entry (check_manifest has checked every key it
        reads; an absent nullable one is None, keys the record does not define are ignored)."""
        return cls(**{f.name: d.get(f.name) for f in fields(cls) if f.name in d or f.default is MISSING})


@dataclass
class Part(Record):
    offset: int  # relative to the tensor's offset
    nbytes: int
    dtype: str
    shape: list[int]


@dataclass
class TensorEntry(Record):
    name: str
    role: str
    layer: int | None
    expert: int | None
    shape: list[int]
    kind: str
    group_size: int | None
    lookup: bool
    parts: dict[str, Part]
    nbytes: int
    file: int = 0
    offset: int = 0
    page: int = 0
    checksum: str = ""

    @classmethod
    def from_json(cls, d: dict) -> "TensorEntry":
        t = super().from_json(d)
        t.parts = {n: Part.from_json(p) for n, p in t.parts.items()}
        return t


@dataclass
class PageEntry(Record):
    id: int
    kind: str
    layer: int | None
    expert: int | None
    tensors: list[str]
    file: int = 0
    offset: int = 0
    nbytes: int = 0
    checksum: str = ""


# ---------------------------------------------------------------------------------------------- layout

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_DENSE_FFN = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def classify(name: str) -> tuple[str, int | None, int | None]:
    """(page kind, layer, expert) of a tensor, from its HF name."""
    if name == "model.embed_tokens.weight":
        return "embedding", None, None
    if name in ("model.norm.weight", "lm_head.weight"):
        return "head", None, None
    m = _LAYER.match(name)
    if not m:
        raise UnsupportedModelError(f"tensor {name!r} has no place in the container layout")
    layer = int(m.group(1))
    if e := _EXPERT.search(name):
        return "expert", layer, int(e.group(1))
    if ".shared_expert." in name:
        return "shared_expert", layer, None
    if _DENSE_FFN.search(name):
        return "ffn", layer, None
    return "attention", layer, None


def tensor_role(name: str, page_kind: str, ndim: int) -> str:
    if page_kind in ("embedding", "expert", "shared_expert", "ffn"):
        return page_kind
    if name == "lm_head.weight":
        return "head"
    if ndim == 1:
        return "norm"
    if name.endswith(".gate.weight") or name.endswith("shared_expert_gate.weight"):
        return "router"
    return "attention"


_KIND_ORDER = {"embedding": 0, "attention": 1, "ffn": 2, "expert": 3, "shared_expert": 4, "head": 9}


def forward_groups(shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, int | None, int | None, list[str]]]:
    """Tensors grouped into page groups, in forward order: embedding, per layer attention then FFN, head."""
    groups: dict[tuple, list[str]] = {}
    for name in shapes:
        kind, layer, expert = classify(name)
        groups.setdefault((kind, layer, expert), []).append(name)

    def order(key):
        kind, layer, expert = key
        return (-1 if kind == "embedding" else 10**9 if kind == "head" else layer, _KIND_ORDER[kind], expert or 0)

    return [(k, l, e, names) for (k, l, e), names in sorted(groups.items(), key=lambda kv: order(kv[0]))]


# Under q4, the attention value projection and the FFN down projection (mixtral: w2) are stored as q8, as
# llama.cpp's Q4_K_M keeps attn_v / ffn_down at higher precision: they carry most of q4's perplexity cost for a
# small share of the bytes (figures: docs/quality.md, "Reading the table").
SENSITIVE = ("self_attn.v_proj.", "down_proj.", ".w2.")


def policy_for(quant_kind: str, requantize: bool = False) -> dict:
    """Which kind each class of tensor is stored as (docs/format.md, "Quantization policy"). `gguf_exact`: the
    GGUF block types kept exactly (the K-quants too unless `requantize`)."""
    edge = "q8" if quant_kind in QUANT_KINDS else quant_kind
    policy = {"linear": quant_kind, "small": "f32", "embedding": edge, "lm_head": edge}
    if quant_kind in QUANT_KINDS:
        policy["gguf_exact"] = {**{t: k.name for t, k in quant.GGUF_EXACT.items()},
                                **({} if requantize else {t: k.name for t, k in quant.GGUF_K_EXACT.items()})}
    if quant_kind == "q4":
        policy["sensitive"] = {"kind": "q8", "names": list(SENSITIVE)}
    return policy


def tensor_kind(name: str, role: str, ndim: int, policy: dict, source_type: str | None) -> str:
    if ndim == 1 or role == "router":
        return policy["small"]
    if source_type is not None and policy["linear"] in QUANT_KINDS:
        exact = policy.get("gguf_exact", {}).get(source_type)
        if exact:
            return exact  # GGUF block types kept bit-exact
    if role == "embedding":
        return policy["embedding"]
    if role == "head":
        return policy["lm_head"]
    sensitive = policy.get("sensitive")
    if sensitive and any(k in name for k in sensitive["names"]):
        return sensitive["kind"]
    return policy["linear"]


def part_layout(kind: str, shape: tuple[int, ...], group_size: int | None,
                source_type: str | None = None) -> dict[str, Part]:
    if kind in FLOAT_KINDS:
        dt = FLOAT_KINDS[kind]
        n = int(np.prod(shape)) * dt.itemsize
        return {"data": Part(0, n, str(dt).removeprefix("torch."), list(shape))}
    parts, off = {}, 0
    qkind = quant.GGUF_EXACT.get(source_type) or kind  # GGUF blocks keep their own scale dtype
    for pname, (dt, pshape) in quant.buffer_layout(qkind, tuple(shape), group_size).items():
        n = int(np.prod(pshape)) * dt.itemsize
        parts[pname] = Part(off, n, str(dt).removeprefix("torch."), list(pshape))
        off = align(off + n, PART_ALIGN)
    return parts


def plan_layout(shapes: dict[str, tuple[int, ...]], tied: bool, quant_kind: str, group_size: int,
                page_size: int, source_types: dict[str, str] | None = None,
                max_file_size: int = 1 << 40, kinds: dict[str, tuple[str, int]] | None = None,
                requantize: bool = False) -> tuple[list[TensorEntry], list[PageEntry], list[int]]:
    """Assign every tensor a kind, an aligned extent and a page. Returns (tensors, pages, file sizes).

    `kinds` (name -> (kind, group size), from a calibrated mixed-precision plan) overrides the policy for the
    tensors it names; GGUF blocks kept exact stay exact (K-quants: unless `requantize`)."""
    policy = policy_for(quant_kind, requantize)
    source_types = source_types or {}
    kinds = kinds or {}
    tensors: list[TensorEntry] = []
    pages: list[PageEntry] = []
    sizes = [0]

    def place(entries: list[TensorEntry], kind: str, layer, expert) -> None:
        total = sum(align(t.nbytes) for t in entries)
        if sizes[-1] and sizes[-1] + total > max_file_size:
            sizes.append(0)
        page = PageEntry(len(pages), kind, layer, expert, [t.name for t in entries], len(sizes) - 1, sizes[-1])
        off = page.offset
        for t in entries:
            t.file, t.offset, t.page = page.file, off, page.id
            off += align(t.nbytes)
        page.nbytes = off - page.offset
        sizes[-1] = off
        pages.append(page)
        tensors.extend(entries)

    for kind, layer, expert, names in forward_groups(shapes):
        entries = []
        for name in names:
            shape = tuple(shapes[name])
            role = tensor_role(name, kind, len(shape))
            src = source_types.get(name)
            tk = tensor_kind(name, role, len(shape), policy, src)
            exact = src if tk in QUANT_KINDS and src in policy.get("gguf_exact", {}) else None
            # q8 is per output channel (its kernel is the fast path); q4 uses --group-size; GGUF blocks: 32
            # (K-quants: their own inner groups).
            gs = quant.GGUF_K_EXACT[exact].group_size if exact in quant.GGUF_K_EXACT else \
                32 if exact else (0 if tk == "q8" else group_size)
            if name in kinds and not exact and len(shape) == 2 and tk in QUANT_KINDS:
                tk, gs = kinds[name]
            if tk == "q4" and not quant.supports(tk, shape, gs):  # K not divisible: the largest group that fits
                gs = next((g for g in (128, 64, 32) if g < gs and quant.supports(tk, shape, g)), gs)
            if tk in QUANT_KINDS and not quant.supports(tk, shape, gs):
                tk, exact = "f32", None  # a shape the kernels cannot take at all
            gs = gs if tk in QUANT_KINDS else None
            parts = part_layout(tk, shape, gs, exact)
            nbytes = max(p.offset + p.nbytes for p in parts.values())
            lookup = role == "embedding" and not tied
            entries.append(TensorEntry(name, role, layer, expert, list(shape), tk, gs, lookup, parts, nbytes))
        if kind in ("ffn",):  # dense FFN: split between tensors at page_size
            chunk: list[TensorEntry] = []
            for t in entries:
                if chunk and sum(align(c.nbytes) for c in chunk) + align(t.nbytes) > page_size:
                    place(chunk, kind, layer, expert)
                    chunk = []
                chunk.append(t)
            place(chunk, kind, layer, expert)
        else:
            place(entries, kind, layer, expert)
    return tensors, pages, sizes


# ---------------------------------------------------------------------------------------------- reader


def read_manifest(path: Path) -> dict:
    mf = path / MANIFEST
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no {MANIFEST}; not a Colibri container (convert it with colibri convert)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{mf}: unreadable manifest ({e}); reconvert the model") from None
    if manifest.get("format") != FORMAT:
        raise ModelLoadError(f"{mf}: not a Colibri container manifest (format {manifest.get('format')!r})")
    version = manifest.get("version")
    if version not in READS:
        raise ModelLoadError(f"{mf}: container format version {version} is not supported by this Colibri (reads"
                             f" versions {', '.join(map(str, READS))}); upgrade Colibri or reconvert the model")
    if version >= 3 and not isinstance(manifest.get("checksum"), str):
        raise ModelLoadError(f"{mf}: the manifest lacks its checksum (damaged file); reconvert the model")
    if "checksum" in manifest and manifest["checksum"] != manifest_checksum(manifest):
        raise ModelLoadError(f"{mf}: the manifest fails its checksum (damaged file); reconvert the model")
    check_manifest(manifest, mf)
    return manifest


def manifest_checksum(manifest: dict) -> str:
    """crc32 of the manifest's content without its own `checksum` key (canonical JSON: sorted keys, so layout and
    whitespace do not matter): a flipped byte in the config or a page entry cannot pass silently."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return checksum_str(zlib.crc32(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()))


# what the reader relies on in each entry: key -> accepted types (an absent nullable key reads as None)
_OPTIONAL_INT = (int, type(None))
_FILE_KEYS = {"name": str, "size": int}
_PAGE_KEYS = {"id": int, "kind": str, "file": int, "offset": int, "nbytes": int, "checksum": str, "tensors": list,
              "layer": _OPTIONAL_INT, "expert": _OPTIONAL_INT}
_TENSOR_KEYS = {"name": str, "kind": str, "shape": list, "file": int, "offset": int, "nbytes": int,
                "checksum": str, "parts": dict, "page": int, "role": str, "lookup": bool, "layer": _OPTIONAL_INT,
                "expert": _OPTIONAL_INT, "group_size": _OPTIONAL_INT}
_PART_KEYS = {"offset": int, "nbytes": int, "dtype": str, "shape": list}


def check_manifest(m: dict, mf: Path) -> None:
    """Every entry the reader uses is present, of its type, and inside its data file (a hand-edited or damaged
    manifest is refused here with one line, not met as a KeyError mid-generation)."""
    def bad(what: str):
        return ModelLoadError(f"{mf}: {what}; the manifest is damaged, reconvert the model")

    def check(e, want: dict, where: str) -> None:
        if not isinstance(e, dict):
            raise bad(f"{where} is not an object")
        for k, typ in want.items():
            v = e.get(k)
            if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
                raise bad(f"{where} lacks a valid {k!r}")

    def entries(key: str, want: dict) -> list:
        items = m.get(key)
        if not isinstance(items, list):
            raise bad(f"{key!r} is missing or not a list")
        for i, e in enumerate(items):
            check(e, want, f"{key}[{i}]")
            for name, part in (e.get("parts") or {}).items():
                check(part, _PART_KEYS, f"{key}[{i}].parts.{name}")
        return items

    if not isinstance(m.get("config"), dict):
        raise bad("'config' is missing")
    files = entries("files", _FILE_KEYS)
    tok = m.get("tokenizer") or {}
    names = [(f"files[{i}].name", f["name"]) for i, f in enumerate(files)]
    names += [(f"tokenizer.{k}", tok[k]) for k in ("file", "chat_template_file", "gguf_metadata_file")
              if isinstance(tok, dict) and tok.get(k)]
    for where, name in names:  # confined to the container's directory (a symlink inside it may point anywhere)
        p = PurePosixPath(name) if isinstance(name, str) else None
        if p is None or not name or p.is_absolute() or ".." in p.parts or "\\" in name:
            raise bad(f"{where} {name!r} is not a file name inside the container's directory")
    for key, want in (("pages", _PAGE_KEYS), ("tensors", _TENSOR_KEYS)):
        for i, e in enumerate(entries(key, want)):
            if key == "pages" and e["id"] != i:
                raise bad(f"pages[{i}] has id {e['id']}")
            if not 0 <= e["file"] < len(files) or e["offset"] < 0 or e["nbytes"] < 0 \
                    or e["offset"] + e["nbytes"] > files[e["file"]]["size"]:
                raise bad(f"{key}[{i}] lies outside its data file")
            why = _parts_problem(e) if key == "tensors" else None
            if why:
                raise bad(f"tensor {e['name']!r}: {why}")


def _parts_problem(e: dict) -> str | None:
    """Why a tensor entry's parts do not lay out its kind and shape as a converter writes them (None: they do).
    The kernels and views trust these shapes and dtypes; an edited one would be a RuntimeError mid-forward."""
    kind, shape, gs = e["kind"], e["shape"], e.get("group_size")
    if not shape or not all(type(d) is int and d > 0 for d in shape):
        return f"shape {shape} is not a list of sizes"
    if kind in FLOAT_KINDS:
        want = {"data": (str(FLOAT_KINDS[kind]).removeprefix("torch."), list(shape))}
    elif kind in QUANT_KINDS:
        try:
            layout = quant.buffer_layout(kind, tuple(shape), gs)
        except ValueError as err:
            return f"kind {kind} cannot hold it ({err})"
        want = {n: (str(dt).removeprefix("torch."), list(s)) for n, (dt, s) in layout.items()}
        sides = tuple(tuple(e["parts"].get(n, {}).get("shape", ())) for n in ("scales", "supers"))
        if kind == "q4k" and sides in quant.q4k_legacy_layouts(tuple(shape)):  # made before version 5
            want["scales"], want["supers"] = ("uint8", list(sides[0])), ("float16", list(sides[1]))
    else:
        return None  # a kind this Colibri does not know: tensor_from_bytes says so, naming it
    parts = e["parts"]
    if sorted(parts) != sorted(want):
        return f"its parts are {sorted(parts)}, a {kind} weight's are {sorted(want)}"
    for name, p in parts.items():
        dtype, pshape = want[name]
        dt = DTYPES.get(p["dtype"])
        # scales keep their source's float dtype (GGUF imports: f16 / f32), the codes exactly theirs
        if dt is None or (p["dtype"] != dtype and not (dt.is_floating_point and DTYPES[dtype].is_floating_point)):
            return f"part {name} has dtype {p['dtype']!r}, not {dtype}"
        if p["shape"] != pshape:
            return f"part {name} has shape {p['shape']}, not {pshape}"
        if math.prod(pshape) * dt.itemsize != p["nbytes"] or p["offset"] < 0 or p["offset"] + p["nbytes"] > e["nbytes"]:
            return f"part {name}'s extent does not hold its shape"
    return None


def version_for(kinds) -> int:
    """The format version a converter writes for a container of tensors of these kinds: 5 where q4k's tile-major
    scale codes and super-scales are in it, else 3 (every reader since version 3 reads it)."""
    return VERSION if "q4k" in kinds else 3


def records(manifest: dict) -> tuple[dict[str, TensorEntry], list[PageEntry]]:
    """A checked manifest's tensors (by name) and pages, as the records the converter wrote."""
    return ({t["name"]: TensorEntry.from_json(t) for t in manifest["tensors"]},
            [PageEntry.from_json(p) for p in manifest["pages"]])


class ContainerCheckpoint:
    """A converted container (loaders.checkpoint.Checkpoint), its manifest's tensors and pages read back as the
    TensorEntry / PageEntry records the converter wrote."""

    format = "container"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = m = read_manifest(self.path)
        self.config: dict[str, Any] = m["config"]
        self.files = [self.path / f["name"] for f in m["files"]]
        for f, info in zip(self.files, m["files"]):
            if not f.is_file():
                raise ModelLoadError(f"{f}: data file missing; the container is incomplete, reconvert it")
            size = f.stat().st_size
            if size != info["size"]:
                state = "truncated" if size < info["size"] else "larger than recorded"
                raise ModelLoadError(f"{f}: {state} ({size} bytes, manifest says {info['size']});"
                                     " the container is damaged, reconvert it")
        self.tensors, self.pages = records(m)
        tok = m.get("tokenizer") or {}
        self.special = dict(tok.get("special") or {})
        self.chat_template = None
        self._tokenizer_json: str | None = None  # checked here, parsed on first use (plan() never needs it)
        required = m["version"] >= 3
        try:
            if tok.get("chat_template_file"):
                data = self._side_file(tok["chat_template_file"], tok.get("chat_template_checksum"), required)
                self.chat_template = data.decode("utf-8")
            if tok.get("file"):
                self._tokenizer_json = self._side_file(tok["file"], tok.get("checksum"), required).decode("utf-8")
        except ModelLoadError:
            raise
        except Exception as e:  # noqa: BLE001 - a missing file, bytes that are not UTF-8
            raise self._side_file_error(e) from None
        self._fds: dict[int, int] = {}

    def _side_file_error(self, e: Exception) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: the tokenizer or chat template file is missing or damaged "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); reconvert the model")

    @functools.cached_property
    def tokenizer(self):
        """The `tokenizers.Tokenizer` of tokenizer.json, or None where the container has none."""
        if self._tokenizer_json is None:
            return None
        from tokenizers import Tokenizer
        try:
            return Tokenizer.from_str(self._tokenizer_json)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type for a damaged file
            raise self._side_file_error(e) from None

    def _side_file(self, name: str, checksum: str | None, required: bool) -> bytes:
        """The bytes of a file beside the manifest (tokenizer, chat template), checked against its checksum: they
        shape every prompt and every decoded token as much as the weights do."""
        path = self.path / name
        data = path.read_bytes()
        if checksum is None and required:
            raise ModelLoadError(f"{path}: the manifest lacks this file's checksum (damaged manifest); reconvert the "
                                 "model")
        if checksum is not None and checksum_str(crc32(data)) != checksum:
            raise ModelLoadError(f"{path}: fails its checksum (the file was changed or damaged); reconvert the model")
        return data

    def gguf_metadata(self) -> Path | None:
        """The source GGUF's metadata file, its checksum checked; None for a container converted from HF weights or
        by a Colibri that did not keep it."""
        tok = self.manifest.get("tokenizer") or {}
        name = tok.get("gguf_metadata_file")
        if not name:
            return None
        try:
            self._side_file(name, tok.get("gguf_metadata_checksum"), required=True)
        except OSError as e:
            raise self._side_file_error(e) from None
        return self.path / name

    @property
    def quantized(self) -> bool:
        """Whether it holds q4/q8 tensors (their dequantize path keeps a scratch buffer)."""
        return any(t.kind in QUANT_KINDS for t in self.tensors.values())

    def default_dtype(self) -> torch.dtype:
        """f32 for an f32 container; else bf16: torch's int4/int8 CPU kernels are vectorized for bf16
        activations only (f32 activations take an exact but slower dequantize path)."""
        return torch.float32 if self.manifest["quant"]["kind"] == "f32" else torch.bfloat16

    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def tensor_dtype(self, name: str) -> str:
        t = self.tensors[name]
        return t.kind + (f"-g{t.group_size}" if t.group_size else "")

    def _fd(self, file: int) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(self.files[file], os.O_RDONLY)
        return self._fds[file]

    def read_extent(self, file: int, offset: int, nbytes: int,
                    into: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
        """`nbytes` of data file `file` from `offset`, read into `into(nbytes)` (a uint8 tensor; default a new one)."""
        buf = into(nbytes) if into is not None else torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        got = os.preadv(self._fd(file), [view], offset)
        if got != nbytes:
            raise ModelLoadError(f"{self.files[file]}: short read at offset {offset} ({got} of {nbytes} bytes);"
                                 " the file was truncated after loading, reconvert it")
        return buf

    def load(self, name: str):
        """A float tensor (a view over the bytes read) or a quantized weight object, its checksum verified (crc32
        over the bytes just read, in memory: cheap beside the read; its rate is in docs/performance.md, "Figures
        moved from source comments")."""
        return self.load_into(name, None)

    def load_into(self, name: str, into: Callable[[int], torch.Tensor] | None):
        """load(), its bytes read into into(nbytes) (a uint8 tensor the result then views; None: a new one)."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the container")
        data = self.read_extent(t.file, t.offset, t.nbytes, into)
        if checksum_str(crc32(data.numpy())) != t.checksum:
            raise ModelLoadError(f"{self.files[t.file]}: tensor {name!r} fails its checksum (at offset "
                                 f"{t.offset}, {t.nbytes} bytes); the file is corrupt — run `colibri "
                                 "verify` and reconvert")
        return tensor_from_bytes(t, data)

    def verify(self, progress: Callable[[int, int], None] | None = None) -> Iterator[tuple[str, str]]:
        """Yield (what, error) for every checksum mismatch: pages first, then the tensors inside a bad page.
        `progress(done, total)`: bytes checked so far, after each page."""
        done, total = 0, sum(p.nbytes for p in self.pages)
        for page in self.pages:
            ok = range_checksum(lambda o, n: self.read_extent(page.file, o, n).numpy(), page.offset,
                                page.nbytes) == page.checksum
            done += page.nbytes
            if progress:
                progress(done, total)
            if ok:
                continue
            bad = [n for n in page.tensors if (t := self.tensors[n]).checksum != checksum_str(crc32(
                self.read_extent(t.file, t.offset, t.nbytes).numpy()))]
            where = f"page {page.id} ({page.kind}, {self.files[page.file].name} @ {page.offset})"
            yield where, f"tensor {bad[0]!r}" if bad else "padding bytes"

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def tensor_from_bytes(t: TensorEntry, buf: torch.Tensor):
    """Views over `buf` (the tensor's extent) for each part: no copies."""
    views = {}
    for pname, p in t.parts.items():
        views[pname] = buf[p.offset:p.offset + p.nbytes].view(DTYPES[p.dtype]).view(p.shape)
    if t.kind in FLOAT_KINDS:
        return views["data"]
    if t.kind not in QUANT_KINDS:
        raise ModelLoadError(f"tensor {t.name!r} is stored as {t.kind!r}, a kind this Colibri does not know; "
                             "upgrade Colibri or reconvert the model")
    return quant.from_buffers(t.kind, tuple(t.shape), t.group_size, views)
