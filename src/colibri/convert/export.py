"""`colibri convert --input CONTAINER --output model.gguf`: a container written back as a GGUF that llama.cpp loads
(docs/format.md, "Export to GGUF").

The metadata (architecture, hyperparameters, tokenizer, chat template) is the source GGUF's, kept beside the
manifest at import (container.GGUF_METADATA). Every tensor goes back to its GGUF type (`quant.kinds.to_gguf`): the
kinds kept from a GGUF give back the imported blocks byte for byte, rows in llama.cpp's order again. A kind no GGUF
type holds (Colibri's own q4) is re-quantized to Q8_0 from its values, with a notice naming it and the cost.
Written a tensor at a time (memory: about the largest tensor) to OUT.partial-PID, renamed into place at the end.
"""

from __future__ import annotations

import errno
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize

from colibri.convert.pipeline import SPACE_MARGIN, Progress
from colibri.core import log
from colibri.core.atomic import atomic_path
from colibri.core.errors import ColibriError, InputError, UnsupportedModelError
from colibri.formats import container
from colibri.formats.container import ContainerCheckpoint, TensorEntry
from colibri.formats.gguf import ARCHITECTURES as READ
from colibri.formats.gguf import (copy_metadata, gguf_tensor_name, gguf_tensor_shape, open_reader, permute_rows,
                                  rope_permuted_heads)
from colibri.quant import kinds as quant

# model_type -> GGUF architecture (mixtral: "llama" with experts)
ARCHITECTURES = {mt: arch for arch, mt in READ.items()} | {"mixtral": "llama"}
FLOAT_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
FALLBACK = "Q8_0"  # what a kind no GGUF type holds is re-quantized to
ROWS_BYTES = 8 << 20  # f32 bytes of rows dequantized per step when re-quantizing


@dataclass
class ExportReport:
    output: Path
    bytes_written: int
    requantized: int  # tensors re-quantized (lossy) because no GGUF type holds their kind
    seconds: float


@dataclass
class _Plan:
    """One GGUF tensor: one container tensor, or (a fused expert tensor) one per expert, in expert order."""

    entries: list[TensorEntry]
    gguf_name: str
    shape: tuple[int, ...]  # numpy order
    gguf_type: str
    exact: bool  # False: re-quantized to FALLBACK from its values
    nbytes: int


def export_gguf(src: str | Path, dst: str | Path, force: bool = False,
                progress: Progress | None = None) -> ExportReport:
    """Write the container `src` as the GGUF file `dst` (see the module's doc). `progress(phase, done, total)`:
    "reading" (the manifest and metadata), then "exporting", in bytes."""
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if dst.exists() and not force:
        raise InputError(f"{dst} already exists; pass --force to overwrite it")
    if not (src / container.MANIFEST).is_file():
        raise InputError(f"{src} is not a Colibri container: an export to GGUF reads one (convert the model to a "
                         "container first)")
    if progress:
        progress("reading", 0, 0)
    ckpt = ContainerCheckpoint(src)
    try:
        plans = _plan(ckpt)
        writer = _writer(ckpt, _metadata_source(ckpt), plans)
        _notice_requantized(plans)
        total = sum(p.nbytes for p in plans)
        free = shutil.disk_usage(dst.parent if dst.parent.exists() else Path(".")).free
        if free < total + SPACE_MARGIN:
            raise ColibriError(f"not enough free space for {dst}: the GGUF needs {total / 2**30:.2f} GiB, "
                               f"{free / 2**30:.2f} GiB are free; free space or choose another --output")
        requantized = sum(len(p.entries) for p in plans if not p.exact)
        try:
            with atomic_path(dst) as tmp:
                requantized += _write(ckpt, writer, plans, tmp, progress, total)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ColibriError(f"no space left on the device writing {dst}: the GGUF needs "
                                   f"{total / 2**30:.2f} GiB; free some space and run the command again") from None
            raise ColibriError(f"writing {dst} failed: {e.strerror or e}; check the --output path (its directory must "
                               "exist and be writable) and the disk") from None
    finally:
        ckpt.close()
    return ExportReport(dst, total, requantized, time.perf_counter() - t0)


def _metadata_source(ckpt: ContainerCheckpoint) -> Path:
    """The GGUF whose key-values the export writes: the metadata kept at import, else (a container converted before
    Colibri kept it) the source GGUF the manifest names, where it still is."""
    kept = ckpt.gguf_metadata()
    if kept is not None:
        return kept
    source = ckpt.manifest.get("source") or {}
    if source.get("kind") != "gguf":
        raise UnsupportedModelError(
            f"{ckpt.path} was converted from Hugging Face weights: an export to GGUF writes the source GGUF's "
            "metadata (tokenizer, hyperparameters), which only a container converted from a GGUF keeps; use "
            "llama.cpp's convert_hf_to_gguf.py on the HF directory instead")
    path = Path(source.get("path") or "")
    if not path.is_file():
        raise UnsupportedModelError(
            f"{ckpt.path} was converted by a Colibri that did not keep the GGUF's metadata, and its source {path} is "
            "gone; convert the GGUF again (the new container keeps it)")
    log.notice(f"colibri: notice: {ckpt.path} keeps no GGUF metadata (converted by an older Colibri): the metadata"
               f" is read from its source {path}")
    return path


def _plan(ckpt: ContainerCheckpoint) -> list[_Plan]:
    """Each GGUF tensor's name, shape, type and bytes, decided from the manifest before a byte is written (the header
    comes first)."""
    cfg = ckpt.config
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(f"{ckpt.path}: exporting a {model_type} model to GGUF is not supported yet; "
                                    f"supported: {', '.join(sorted(ARCHITECTURES))}")
    plans: dict[str, _Plan] = {}
    for t in ckpt.tensors.values():
        if t.kind in FLOAT_TYPES:
            gtype, exact = FLOAT_TYPES[t.kind], True
        elif t.kind in container.QUANT_KINDS:
            scales = next((p for n, p in t.parts.items() if n.startswith("scales")), None)
            kind = quant.stored_kind(t.kind, t.group_size, container.DTYPES[scales.dtype] if scales else None)
            gtype = quant.gguf_type(kind)
            exact = gtype is not None
            gtype = gtype or FALLBACK
        else:
            raise UnsupportedModelError(f"{ckpt.path}: tensor {t.name!r} is stored as {t.kind!r}, a kind this "
                                        "Colibri cannot export; upgrade Colibri")
        block, size = GGML_QUANT_SIZES[QT[gtype]]
        nbytes = int(np.prod(t.shape)) // block * size
        name, expert = gguf_tensor_name(t.name, model_type)
        p = plans.get(name)
        if p is None:
            plans[name] = _Plan([t], name, gguf_tensor_shape(name, tuple(t.shape)), gtype, exact, nbytes)
            continue
        # the next expert of a fused tensor: stored as the others (they were one GGUF tensor)
        if expert != len(p.entries) or (t.kind, list(t.shape), t.group_size) != (
                p.entries[0].kind, p.entries[0].shape, p.entries[0].group_size):
            raise UnsupportedModelError(f"{ckpt.path}: the experts of {name} are not stored alike ({t.name}); "
                                        "they cannot be written as one GGUF tensor")
        p.entries.append(t)
        p.nbytes += nbytes
    for p in plans.values():
        if len(p.entries) > 1 or gguf_tensor_name(p.entries[0].name, model_type)[1] is not None:
            p.shape = (len(p.entries), *p.shape)
    return list(plans.values())


def _notice_requantized(plans: list[_Plan]) -> None:
    """One line on stderr per kind re-quantized because no GGUF type holds it: what it costs."""
    lossy: dict[tuple[str, int | None], list[TensorEntry]] = {}
    for p in plans:
        if not p.exact:
            lossy.setdefault((p.entries[0].kind, p.entries[0].group_size), []).extend(p.entries)
    nbytes = {t.name: p.nbytes // len(p.entries) for p in plans for t in p.entries}
    for (kind, gs), ts in sorted(lossy.items()):
        more = sum(nbytes[t.name] - t.nbytes for t in ts)
        log.warn(f"colibri: notice: {len(ts)} {kind} tensors (group {gs}) have no GGUF type: re-quantized to"
                 f" {FALLBACK} from their values (lossy: each value moves by up to half a {FALLBACK} step, 1/254 of"
                 f" its 32-value block's largest; {more / 2**20:+.1f} MiB)")


def _writer(ckpt: ContainerCheckpoint, meta: Path, plans: list[_Plan]) -> GGUFWriter:
    """A GGUFWriter holding the metadata of `meta` (checked to describe the container's model) and the tensor table,
    its file not opened yet."""
    cfg = ckpt.config
    arch = ARCHITECTURES[cfg["model_type"]]
    reader = open_reader(meta)  # a large vocabulary parsed: gone once copied
    fields = {k: f.contents() for k, f in reader.fields.items()
              if k in ("general.architecture", f"{arch}.block_count", f"{arch}.embedding_length")}
    want = {"general.architecture": arch, f"{arch}.block_count": cfg["num_hidden_layers"],
            f"{arch}.embedding_length": cfg["hidden_size"]}
    if fields != want:
        raise UnsupportedModelError(f"{meta}: its metadata ({fields}) does not describe the model of {ckpt.path} "
                                    f"({want}); convert the GGUF again")
    w = GGUFWriter(None, arch)
    copy_metadata(reader, w)
    for p in plans:
        w.add_tensor_info(p.gguf_name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=QT[p.gguf_type])
    return w


def _write(ckpt: ContainerCheckpoint, w: GGUFWriter, plans: list[_Plan], path: Path, progress: Progress | None,
           total: int) -> int:
    """Write the GGUF at `path`, a tensor at a time; return how many more tensors were re-quantized on the way (q8
    whose scales f16 cannot hold)."""
    requantized = 0
    try:
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        if progress:
            progress("exporting", 0, total)
        for p in plans:
            data, lost = _tensor_data(ckpt, p)
            requantized += len(lost)
            for name, why in lost:
                log.warn(f"colibri: notice: {name}: {why}: re-quantized to {FALLBACK} from its values (lossy: each"
                         f" value moves by up to half a {FALLBACK} step)")
            w.write_tensor_data(data)
            done += p.nbytes
            if progress:
                progress("exporting", done, total)
    finally:
        w.close()
    return requantized


def _tensor_data(ckpt: ContainerCheckpoint, p: _Plan) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """The bytes of GGUF tensor `p` (a fused expert tensor: each expert's in turn, one expert converted at a time),
    and (name, why) of the container tensors its planned type turned out not to hold exactly (re-quantized)."""
    if len(p.entries) == 1:
        data, why = _gguf_data(ckpt, p.entries[0], p)
        lost = [(p.entries[0].name, why)] if why else []
    else:
        data, lost, pos = np.empty(p.nbytes, dtype=np.uint8), [], 0
        for t in p.entries:
            part, why = _gguf_data(ckpt, t, p)
            data[pos:pos + part.nbytes] = part.reshape(-1)
            pos += part.nbytes
            lost += [(t.name, why)] if why else []
    if data.nbytes != p.nbytes:
        raise ColibriError(f"internal: {p.gguf_name} is {data.nbytes} bytes as {p.gguf_type}, planned {p.nbytes}")
    return data, lost


def _gguf_data(ckpt: ContainerCheckpoint, t: TensorEntry, p: _Plan) -> tuple[np.ndarray, str | None]:
    """The stored bytes of container tensor `t` in GGUF form (rows in llama.cpp's order), and why they were
    re-quantized where the planned exact type turned out not to hold its values (None otherwise)."""
    value = ckpt.load(t.name)
    why = None
    if t.kind in FLOAT_TYPES:
        data = value.contiguous().view(torch.uint8).numpy()
    elif p.exact:
        try:
            data = quant.to_gguf(value)
        except ValueError as e:  # q8 with a scale f16 cannot hold
            data, why = _requantize(value), str(e).removeprefix("to_gguf: ")
    else:
        data = _requantize(value)
    if ckpt.config["model_type"] == "gemma3_text" and p.gguf_name.endswith("norm.weight"):
        # Gemma's norms: the file keeps 1 + w (formats.gguf), the container w. Exact back to the file's value for
        # every stored value at least 0.5; below, the import's w rounded (w + 1 is then that rounded value's)
        data = (value.float() + 1.0).numpy().view(np.uint8)
    data = data.reshape(t.shape[0], -1)
    heads = rope_permuted_heads(t.name, ckpt.config)
    if heads is not None:
        data = permute_rows(data, heads)
    return data, why


def _requantize(w) -> np.ndarray:
    """FALLBACK blocks of a quantized weight's values, a few MiB of rows dequantized at a time."""
    n, k = w.shape
    step = max(1, ROWS_BYTES // (4 * k))
    return np.concatenate([gguf_quantize(w.rows(torch.arange(r, min(n, r + step))).numpy(), QT[FALLBACK])
                           for r in range(0, n, step)])
