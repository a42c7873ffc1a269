"""`colibri convert`: HF directory or GGUF file -> Colibri container (docs/format.md).

Streams tensor by tensor (peak memory ~ the largest tensor, whatever the model size), writes into a sibling
`OUT.partial-<fingerprint>` directory, journals finished pages so an interrupted run resumes, verifies every
checksum, and only then renames the directory into place. `default_container`: the embedded default model's
container, converted once under the cache directory and reused.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from colibri.core import __version__
from colibri.convert import calibrate
from colibri.convert import imatrix
from colibri.formats import container
from colibri.convert import mixed
from colibri.quant import kinds as quant
from colibri.quant import kquant
from colibri.convert import tied
from colibri.convert.managed import mark_verified, trusted
from colibri.core import log
from colibri.core.atomic import fsync_dir, write_json
from colibri.formats.container import (ALIGN, FORMAT, MANIFEST, VERSION, ContainerCheckpoint, checksum_str, crc32,
                               plan_layout)
from colibri.core.defaults import cache_dir, default_model_path
from colibri.core.errors import ColibriError, InputError, ModelLoadError
from colibri.formats.checkpoint import check_tensors
from colibri.models import family, open_model

QUANT_ALIASES = {"q4_0": "q4", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# llama.cpp file types reproduced from float weights (mixed.llama_types, quant/kquant.py): the base kind whose
# policy takes any tensor the recipe leaves out
RECIPE_BASE = {"q4_k_m": "q4", "q5_k_m": "q8", "q6_k": "q8", "q8_0": "q8"}
IMATRIX = ("none", "builtin")  # or a llama.cpp importance matrix file (convert/imatrix.py)
QUANTS = ("q4", "q8", "bf16", "f16", "f32")
JOURNAL = "progress.json"
# the phases a conversion reports, in order; the byte-counted ones give (done, total) in bytes, calibrating in layers
PHASES = ("reading", "calibrating", "checking", "converting", "verifying", "publishing")
MIXES = ("measured", "fixed")  # q4 precision mix: by measured sensitivity under the budget, or the fixed names
SPACE_MARGIN = 64 << 20


@dataclass
class ConvertOptions:
    """`calibration` (q4 only): "builtin" (CPython's own prose and source), a UTF-8 text file, or "none" (the
    fixed-name policy: v_proj/down_proj and the tables at q8, plain q4 fit). A GGUF's Q4_K / Q6_K tensors are
    kept exactly (kinds q4k / q8k) unless `requantize`, so the policy only decides the others. `mix`: "measured" (q8 for the
    tensors with the most measured sensitivity per byte, within `bits_per_weight`, default what llama.cpp's
    Q4_K_M would take for the same tensors) or "fixed" (the fixed names, with the calibrated fit)."""

    quant: str = "q4"
    group_size: int = 64
    page_size_mb: int = 64
    calibration: str = "none"  # the fixed policy (why: docs/quality.md, "What the measurements say")
    bits_per_weight: float | None = None
    calibration_tokens: int = calibrate.DEFAULT_TOKENS
    mix: str = "measured"
    requantize: bool = False  # GGUF K-quants, IQ4, Q5_0, Q5_1: re-quantized by the policy (lossy), not kept exactly
    imatrix: str = "none"  # K-quant recipes: "builtin" (measured on calibration text) or a llama.cpp imatrix file
    recipe: str | None = None  # set from `quant` when it names a llama.cpp file type (RECIPE_BASE)

    @property
    def calibrated(self) -> bool:
        return self.quant == "q4" and self.recipe is None and self.calibration != "none"

    @property
    def calibration_file(self) -> str | None:
        return None if self.calibration in ("builtin", "none") else self.calibration

    def __post_init__(self) -> None:
        self.quant = QUANT_ALIASES.get(self.quant.lower(), self.quant.lower())
        if self.quant in RECIPE_BASE:
            self.recipe, self.quant = self.quant, RECIPE_BASE[self.quant]
        if self.quant not in QUANTS:
            raise InputError(f"--quant {self.quant!r} is not supported; choose one of {', '.join(QUANTS)}, "
                             f"{', '.join(RECIPE_BASE)} (aliases: {', '.join(QUANT_ALIASES)})")
        if self.recipe and self.requantize:
            raise InputError(f"--requantize re-quantizes a GGUF by the q4 policy; it does not combine with --quant "
                             f"{self.recipe}")
        if self.imatrix not in IMATRIX and not Path(self.imatrix).is_file():
            raise InputError(f"--imatrix {self.imatrix}: no such file (give llama-imatrix's .gguf / .dat file, "
                             f"or one of {', '.join(IMATRIX)})")
        if self.imatrix != "none" and self.recipe is None:
            raise InputError(f"--imatrix applies to the K-quant recipes ({', '.join(RECIPE_BASE)}), not --quant "
                             f"{self.quant}; use --calibration for q4")
        if self.group_size not in (32, 64, 128):
            raise InputError(f"--group-size must be 32, 64 or 128 (got {self.group_size})")
        if not 1 <= self.page_size_mb <= 4096:
            raise InputError(f"--page-size must be between 1 and 4096 MB (got {self.page_size_mb})")
        if self.bits_per_weight is not None and not 4 <= self.bits_per_weight <= 16:
            raise InputError(f"--bits-per-weight must be between 4 and 16 (got {self.bits_per_weight})")
        if self.calibration_file and not Path(self.calibration_file).is_file():
            raise InputError(f"--calibration {self.calibration_file}: no such file (give a UTF-8 text file, "
                             "'builtin' or 'none')")
        if self.mix not in MIXES:
            raise InputError(f"--mix {self.mix!r}: choose one of {', '.join(MIXES)}")
        if not 16 <= self.calibration_tokens <= 1 << 20:
            raise InputError(f"--calibration-tokens must be between 16 and 1048576 (got {self.calibration_tokens})")


@dataclass
class ConvertReport:
    output: Path
    bytes_written: int
    total_bytes: int
    resumed_pages: int
    seconds: float


def source_fingerprint(src: Path, opts: ConvertOptions, name: str | None = None) -> str:
    """Identity of (input files, options): a partial output is resumed only for the same fingerprint. name: a file
    source's name as it was given (a link's: the hub cache links each file to a blob named by its hash), else its
    own."""
    files = [(name or src.name, src)] if src.is_file() else [(p.name, p) for p in sorted(src.iterdir()) if p.is_file()]
    h = hashlib.sha256(f"{FORMAT}/{VERSION}/{asdict(opts)}".encode())
    for given, f in files:
        st = f.stat()
        h.update(f"{given}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _pwrite(fd: int, data, offset: int) -> None:
    """Write all of `data` at `offset` (the one place bytes reach the disk; tests inject failures here)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _parts(entry: container.TensorEntry, value) -> list[tuple[int, memoryview]]:
    """The stored bytes of one tensor's parts, (offset in its extent, bytes) in offset order, as views (no
    copies: a quantized weight's buffers are contiguous already)."""
    if entry.kind in container.FLOAT_KINDS:
        buffers = {"data": value.to(container.FLOAT_KINDS[entry.kind]).contiguous()}
    else:
        buffers = value.buffers()
    out = []
    for pname, part in entry.parts.items():
        raw = memoryview(buffers[pname].contiguous().reshape(-1).view(torch.uint8).numpy())
        if raw.nbytes != part.nbytes:
            raise ColibriError(f"internal: {entry.name}.{pname} is {raw.nbytes} bytes, layout says {part.nbytes}")
        out.append((part.offset, raw))
    return sorted(out, key=lambda p: p[0])


def write_tensor(fd: int, entry: container.TensorEntry, value) -> str:
    """Write one tensor's extent (its parts at their offsets, zeros between and after) at entry.offset, straight
    from the value's buffers; return its checksum (crc32 over the extent, computed as it is written)."""
    crc, pos = 0, 0
    for off, raw in _parts(entry, value):
        if off > pos:
            gap = bytes(off - pos)
            crc = crc32(gap, crc)
            _pwrite(fd, gap, entry.offset + pos)
        crc = crc32(raw, crc)
        _pwrite(fd, raw, entry.offset + off)
        pos = off + raw.nbytes
    if pos < entry.nbytes:
        tail = bytes(entry.nbytes - pos)
        crc = crc32(tail, crc)
        _pwrite(fd, tail, entry.offset + pos)
    return checksum_str(crc)


def _page_checksum(fds: list[int], page: container.PageEntry) -> str:
    """The checksum of a page as the file holds it now."""
    fd = fds[page.file]
    return container.range_checksum(lambda o, n: os.pread(fd, n, o), page.offset, page.nbytes)


def encode(entry: container.TensorEntry, ckpt, cal=None, recipe: dict[str, str] | None = None) -> object:
    """Source tensor -> the stored value: a float tensor or a quantized weight (q4: fitted with the importance
    of its input channels from the calibration `cal` when given, or the weight calibration already fitted;
    `recipe`: name -> the GGUF block type a K-quant recipe makes of a float source tensor, weighted by `cal`'s
    importance when given)."""
    gtype = (recipe or {}).get(entry.name)
    if gtype is not None and entry.kind in container.QUANT_KINDS:
        w = ckpt.load(entry.name)
        importance = cal.importance.get(entry.name) if cal is not None else None
        return quant.from_gguf(kquant.quantize_blocks(w, gtype, importance), gtype, tuple(w.shape))
    if entry.kind in container.QUANT_KINDS and ckpt.format == "gguf":
        qtype, raw, shape = ckpt.raw_tensor(entry.name, copy=False)  # converted from the map a block at a time
        try:
            exact = {**quant.GGUF_EXACT, **quant.GGUF_K_EXACT}.get(qtype.name)
            if exact is not None and exact.name == entry.kind:
                return quant.from_gguf(raw, qtype, tuple(shape))
        finally:
            del raw
            ckpt.release(entry.name)
    if cal is not None and entry.kind == "q4":
        q = cal.quantized.pop(entry.name, None)
        if q is not None and q.group_size == entry.group_size:
            return q
    w = ckpt.load(entry.name)
    if entry.kind in container.QUANT_KINDS:
        importance = cal.importance.get(entry.name) if cal is not None and entry.kind == "q4" else None
        return quant.quantize(w, entry.kind, entry.group_size, importance=importance)  # f32 a few rows at a time
    return w


def tokenizer_files(ckpt, out: Path) -> dict:
    """Write tokenizer.json and chat_template.jinja beside the manifest (and a GGUF source's metadata: what an
    export to GGUF writes back); return the manifest's tokenizer entry."""
    entry = {"file": None, "chat_template_file": None, "special": ckpt.special}
    if ckpt.format == "gguf":
        ckpt.write_metadata(out / container.GGUF_METADATA)
        data = (out / container.GGUF_METADATA).read_bytes()
        entry.update(gguf_metadata_file=container.GGUF_METADATA, gguf_metadata_checksum=checksum_str(crc32(data)))
    if getattr(ckpt, "tokenizer", None) is not None:
        data = ckpt.tokenizer.to_str().encode("utf-8")
        (out / "tokenizer.json").write_bytes(data)
        entry.update(file="tokenizer.json", checksum=checksum_str(crc32(data)))
    if ckpt.chat_template:
        data = ckpt.chat_template.encode("utf-8")
        (out / "chat_template.jinja").write_bytes(data)
        entry.update(chat_template_file="chat_template.jinja", chat_template_checksum=checksum_str(crc32(data)))
    return entry


Progress = Callable[[str, int, int], None]  # (phase, done, total): see PHASES


def convert(src: str | Path, dst: str | Path, opts: ConvertOptions, force: bool = False,
            progress: Progress | None = None,
            kinds: dict[str, tuple[str, int]] | None = None) -> ConvertReport:
    """Convert `src` into the container directory `dst`. `progress(phase, done, total)` is called as it goes, from
    the start (PHASES). `kinds` (name -> (kind, group size)) overrides the quantization policy for the tensors it
    names."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and not force:
        raise InputError(f"{dst} already exists; pass --force to overwrite it")
    if progress:
        progress("reading", 0, 0)
    ckpt, args, decoder = open_model(src)
    if isinstance(ckpt, ContainerCheckpoint):
        ckpt.close()
        raise InputError(f"{src} is already a Colibri container; convert from the HF directory or GGUF file it was "
                         "made from (or give --output NAME.gguf to write it back as a GGUF)")
    shapes = decoder.weight_shapes()
    check_tensors(ckpt, shapes, src)
    gguf = ckpt.format == "gguf"
    tie = args.tie_word_embeddings
    if gguf and opts.quant in container.QUANT_KINDS and (table := tied.tied_table_source(ckpt)):
        ckpt, tie = tied.TiedTable(ckpt, table), True  # one matrix stored twice: store it once
        del shapes[tied.HEAD]
        args = family(ckpt.config["model_type"]).args(ckpt.config)
        decoder = family(ckpt.config["model_type"]).Model(args)
    source_types = {n: ckpt.tensor_dtype(n) for n in shapes} if gguf and opts.quant in container.QUANT_KINDS else {}
    source = {"kind": "gguf" if gguf else "huggingface", "path": str(src.resolve())}
    fingerprint = source_fingerprint(src, opts)
    imatrix_file = None if opts.imatrix in IMATRIX else opts.imatrix
    if kinds or opts.calibration_file or imatrix_file:  # an explicit plan, a text, an imatrix: the output's identity
        extra = f"{sorted((kinds or {}).items())}{calibrate.text_digest(opts.calibration_file)}" \
                f"{calibrate.text_digest(imatrix_file)}"
        fingerprint = hashlib.sha256(f"{fingerprint}{extra}".encode()).hexdigest()[:16]
    cal, policy, recipe = None, None, None
    if opts.recipe:  # the float tensors get llama.cpp's block types; a GGUF's quantized ones stay as they are
        recipe = {n: t for n, t in mixed.llama_types(shapes, args.num_layers, tie, opts.recipe).items()
                  if source_types.get(n, "F32") in ("F32", "F16", "BF16")}
        source_types = {**source_types, **recipe}  # so the layout plans them as those blocks kept exactly
        policy = {**{k: v for k, v in container.policy_for(opts.quant).items() if k != "sensitive"},
                  "recipe": opts.recipe + ("" if opts.imatrix == "none" else f" (imatrix {opts.imatrix})")}
    try:
        fresh = force
        if recipe and opts.imatrix == "builtin":
            ids = calibrate.calibration_ids(getattr(ckpt, "tokenizer", None), args.vocab_size, None,
                                            opts.calibration_tokens)
            cal = calibrate.calibrate(ckpt, args, decoder, ids, {}, progress=progress, measure=False)
        elif recipe and opts.imatrix != "none":
            cal = calibrate.Calibration(importance=imatrix.importance(
                imatrix.read(opts.imatrix), {n: shapes[n] for n in recipe}, ckpt.config["model_type"], opts.imatrix))
        if opts.calibrated and not kinds:
            work = dst.with_name(f"{dst.name}.partial-{fingerprint}")
            _open_journal(work, fingerprint, fresh)  # --force: the calibration starts over too
            fresh = False
            kinds, cal, record = mixed.calibrated_plan(ckpt, args, decoder, shapes, tie, opts, source_types, work,
                                                        progress)
            policy = {"linear": "q4", "small": "f32", "mixed": record} if record else None
        return write_container(dst, ckpt.config, shapes, tie, opts,
                               lambda entry: encode(entry, ckpt, cal, recipe), fingerprint, source,
                               lambda work: tokenizer_files(ckpt, work), source_types, progress,
                               kinds, policy, fresh=fresh)
    finally:
        ckpt.close()


def write_container(dst: Path, config: dict, shapes: dict[str, tuple[int, ...]], tied: bool, opts: ConvertOptions,
                    encode_fn: Callable[[container.TensorEntry], object], fingerprint: str, source: dict,
                    tokenizer_fn: Callable[[Path], dict], source_types: dict[str, str] | None = None,
                    progress: Progress | None = None,
                    kinds: dict[str, tuple[str, int]] | None = None, policy: dict | None = None,
                    fresh: bool = False) -> ConvertReport:
    """Lay out, write, journal, verify and atomically publish a container whose tensors `encode_fn` produces.
    An interrupted run's partial directory is resumed (`fresh`: discarded), its journaled pages checked first."""
    t0 = time.perf_counter()
    tensors, pages, sizes = plan_layout(shapes, tied, opts.quant, opts.group_size, opts.page_size_mb << 20,
                                        source_types, kinds=kinds, requantize=opts.requantize)
    total = sum(sizes)
    _notice_requantized(tensors, source_types or {}, opts)
    work = dst.with_name(f"{dst.name}.partial-{fingerprint}")
    fds: list[int] = []
    try:
        journal = _open_journal(work, fingerprint, fresh)
        _check_space(dst.parent if dst.parent.exists() else Path("."), total, work)
        for i in range(len(sizes)):
            fds.append(os.open(work / f"data-{i:05d}.bin", os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        if not _journaled(work):
            shutil.rmtree(work, ignore_errors=True)  # nothing worth resuming
        raise ColibriError(f"cannot write the container at {work}: {e.strerror}; check that the --output "
                           "directory is writable") from None
    by_name = {t.name: t for t in tensors}
    ahead = None
    try:
        for i, size in enumerate(sizes):
            os.ftruncate(fds[i], size)
        done = _intact_pages(journal, pages, fds, progress)
        written = sum(p.nbytes for p in pages if p.id in done)
        # The next tensor is encoded on a second thread while this one is written and checksummed (numpy, torch,
        # zlib and pwrite let go of the GIL): two tensors in memory at most.
        todo = iter([by_name[n] for page in pages if page.id not in done for n in page.tensors])
        ahead = ThreadPoolExecutor(1, thread_name_prefix="colibri-encode")
        nxt = next(todo, None)
        pending = ahead.submit(encode_fn, nxt) if nxt is not None else None
        for page in pages:
            if page.id in done:
                page.checksum = done[page.id]["checksum"]
                for n in page.tensors:
                    by_name[n].checksum = done[page.id]["tensors"][n]
                continue
            for n in page.tensors:
                t = by_name[n]
                value = pending.result()
                nxt = next(todo, None)
                pending = ahead.submit(encode_fn, nxt) if nxt is not None else None
                t.checksum = write_tensor(fds[t.file], t, value)
                del value
                written += t.nbytes
                if progress:
                    progress("converting", written, total)
            os.fdatasync(fds[page.file])
            page.checksum = _page_checksum(fds, page)
            journal["pages"][str(page.id)] = {"checksum": page.checksum,
                                              "tensors": {n: by_name[n].checksum for n in page.tensors}}
            write_json(work / JOURNAL, journal)
        for fd in fds:
            os.fsync(fd)
        if progress:  # the tensors' bytes leave out the alignment between them: the phase ends at the total
            progress("converting", total, total)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            shutil.rmtree(work, ignore_errors=True)
            raise ColibriError(f"no space left on the device writing {work}: the container needs {total / 2**30:.2f}"
                               " GiB; free some space and run the command again") from None
        raise ColibriError(f"writing {work} failed: {e.strerror or e}; check the disk and run the command again "
                           "(finished pages are kept and resumed)") from None
    finally:
        if ahead is not None:
            ahead.shutdown(cancel_futures=True)
        for fd in fds:
            os.close(fd)

    manifest = {
        "format": FORMAT, "version": container.version_for({t.kind for t in tensors}),
        "created_by": f"colibri {__version__}",
        "source": {**source, "fingerprint": fingerprint},
        "config": config,
        "tokenizer": tokenizer_fn(work),
        "quant": {"kind": opts.quant, "group_size": opts.group_size,
                  "policy": policy or container.policy_for(opts.quant, opts.requantize)},
        "alignment": ALIGN, "page_size": opts.page_size_mb << 20,
        "files": [{"name": f"data-{i:05d}.bin", "size": s} for i, s in enumerate(sizes)],
        "tensors": [asdict(t) for t in tensors],
        "pages": [asdict(p) for p in pages],
    }
    manifest = json.loads(json.dumps(manifest))  # as a reader will parse it (tuples become lists)
    manifest["checksum"] = container.manifest_checksum(manifest)
    write_json(work / MANIFEST, manifest)
    bad = next(container.ContainerCheckpoint(work).verify(
        (lambda done, of: progress("verifying", done, of)) if progress else None), None)
    if bad:
        raise ColibriError(f"verification failed after writing {work}: {bad[0]}: {bad[1]}; check the disk and "
                           "rerun with --force")
    if progress:
        progress("publishing", 0, 0)
    (work / JOURNAL).unlink()
    fsync_dir(work)
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(work, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(work, dst)
    fsync_dir(dst.parent)
    return ConvertReport(dst, written, total, len(done), time.perf_counter() - t0)


def _notice_requantized(tensors: list[container.TensorEntry], source_types: dict[str, str],
                        opts: ConvertOptions) -> None:
    """One line on stderr per GGUF block type that is re-quantized (lossy) because Colibri has no exact kind for it
    (the K-quants when --requantize asks for it are not news)."""
    lost: dict[str, list[int]] = {}
    for t in tensors:
        src = source_types.get(t.name)
        if src is None or src in ("F32", "F16", "BF16") or t.kind not in container.QUANT_KINDS:
            continue
        exact = {**quant.GGUF_EXACT, **quant.GGUF_K_EXACT}.get(src)
        if (exact is None or exact.name != t.kind) and not (opts.requantize and src in quant.GGUF_K_EXACT):
            lost.setdefault(src, []).append(t.nbytes)
    for src, sizes in sorted(lost.items()):
        log.warn(f"colibri: notice: {len(sizes)} {src} tensors have no exact kind in Colibri yet: re-quantized to"
                 f" {opts.quant} by the fixed policy (lossy, a few % perplexity: docs/quality.md)")


def _intact_pages(journal: dict, pages: list[container.PageEntry], fds: list[int],
                  progress: Progress | None = None) -> dict[int, dict]:
    """The journaled pages whose bytes on disk still match their journaled checksum (crc over one read of each):
    a page damaged after it was journaled is dropped from the journal and written again, so a resumed run can
    never keep a bad page forever."""
    done = {}
    journaled = [p for p in pages if str(p.id) in journal["pages"]]
    checked, of = 0, sum(p.nbytes for p in journaled)
    for page in journaled:
        entry = journal["pages"][str(page.id)]
        if _page_checksum(fds, page) == entry.get("checksum"):
            done[page.id] = entry
        else:
            del journal["pages"][str(page.id)]
        checked += page.nbytes
        if progress:
            progress("checking", checked, of)
    return done


def _journaled(work: Path) -> bool:
    """Whether `work` holds a journal with finished pages (worth resuming)."""
    try:
        return bool(json.loads((work / JOURNAL).read_text()).get("pages"))
    except (OSError, ValueError, AttributeError):
        return False


def _open_journal(work: Path, fp: str, fresh: bool = False) -> dict:
    """Resume state from an earlier interrupted run with the same fingerprint, or a fresh partial directory."""
    jf = work / JOURNAL
    if jf.is_file() and not fresh:
        try:
            journal = json.loads(jf.read_text())
            if journal.get("fingerprint") == fp:
                return journal
        except (OSError, json.JSONDecodeError):
            pass
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    journal = {"fingerprint": fp, "pages": {}}
    write_json(jf, journal)
    return journal


def _check_space(parent: Path, total: int, work: Path) -> None:
    have = sum(f.stat().st_blocks * 512 for f in work.glob("data-*.bin"))
    free = shutil.disk_usage(parent).free
    need = total - have + SPACE_MARGIN
    if free < need:
        shutil.rmtree(work, ignore_errors=True)
        raise ColibriError(f"not enough free space in {parent}: the container needs {need / 2**30:.2f} GiB more,"
                           f" {free / 2**30:.2f} GiB are free; free space or choose another --output")


# ---------------------------------------------------------------------------------------------- the default model

DEFAULT_KIND = "q4"  # the container kind of the default model (docs/quality.md, "The default model")


def cached_container(src: Path, root: Path, kind: str, announce=None, label: str = "the default model",
                     prune: bool = False) -> Path:
    """A container of `src` under `root`, converted on first use and reused while `src` is unchanged.

    Safe against two processes at once (the second waits on a lock, then finds the first's container) and
    against a damaged cache (a container that fails its checksums is converted again). `announce(text)` is told
    before a conversion starts. prune: a conversion also removes the containers of a source by src's name that is
    gone or changed (_remove_stale): for the default model, a package's file; a user's GGUF keeps its containers,
    which may be all that is left of a file deleted on purpose (`colibri rm` removes them). A root that cannot be
    written gets the container in a private temporary directory instead, removed at exit (announced)."""
    opts = ConvertOptions(quant=kind)
    dst = root / f"{src.stem}-{kind}-{source_fingerprint(src, opts)}"
    if _intact(dst):
        return dst
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{dst.name}.lock", "w")
    except OSError as e:
        return _private_container(src, root, kind, opts, announce, label, e)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if _intact(dst):  # another process converted it while this one waited
            return dst
        if announce:
            announce(f"converting {src.name} to a {kind} container in {dst} (first use only)")
        convert(src, dst, opts, force=True, progress=progress_lines(label))
    gone = _remove_stale(src, root, kind, dst, opts) if prune else []
    if gone and announce:
        announce(f"removed {len(gone)} older {kind} container(s) of {src.name} whose source is gone or changed"
                 f" ({sum(gone) / 1e6:.0f} MB)")
    return dst


def _private_container(src: Path, root: Path, kind: str, opts: ConvertOptions, announce, label: str,
                       err: OSError) -> Path:
    """cached_container's fallback where `root` cannot be written: a conversion into a private temporary directory,
    removed when the process exits (the kernel cache does the same: kernels/build.py)."""
    import atexit
    import tempfile

    private = Path(tempfile.mkdtemp(prefix=f"colibri-{src.stem}-"))
    atexit.register(shutil.rmtree, private, True)
    dst = private / f"{src.stem}-{kind}"
    if announce:
        announce(f"the model cache {root} is not writable ({err.strerror or err}); converting {src.name} to a {kind}"
                 f" container in a private temporary directory, not kept (set COLIBRI_CACHE to a writable directory"
                 f" to keep it)")
    convert(src, dst, opts, force=True, progress=progress_lines(label))
    return dst


def _remove_stale(src: Path, root: Path, kind: str, dst: Path, opts: ConvertOptions) -> list[int]:
    """Delete the containers under `root` that cached_container made of a source by src's name whose source file is
    now gone or changed (each fresh venv's copy of a packaged model, a re-downloaded file: each got a container of
    its own, and none was ever removed); those whose source is still there as it was are kept, in use or not, and
    so is one being converted (its lock is held). -> the bytes each removed one held."""
    gone = []
    for d in root.iterdir():
        if d == dst or not d.name.startswith(f"{src.stem}-{kind}-") or not d.is_dir():
            continue
        try:
            source = json.loads((d / MANIFEST).read_text()).get("source") or {}
            path = Path(source["path"])  # (resolved: a link's target)
            if path.exists() and source["fingerprint"] in (source_fingerprint(path, opts),
                                                           source_fingerprint(path, opts, src.name)):
                continue
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue  # no readable manifest (a damaged one, or a conversion's work): `colibri rm` is for those
        with open(root / f"{d.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # being converted again right now
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            shutil.rmtree(d, ignore_errors=True)
            if d.exists():
                continue
            (root / f"{d.name}.verified").unlink(missing_ok=True)
            (root / f"{d.name}.lock").unlink(missing_ok=True)
        gone.append(size)
    return gone


def _intact(path: Path) -> bool:
    """Whether the cached container at `path` can be used: its manifest reads and checks, and either it was
    verified whole before and its identity is unchanged (managed.trusted) or every checksum passes now."""
    if not (path / "manifest.json").is_file():
        return False
    try:
        ckpt = ContainerCheckpoint(path)
    except ModelLoadError:
        return False
    try:
        if trusted(path):
            return True
        intact = next(ckpt.verify(), None) is None
    finally:
        ckpt.close()
    if intact:
        mark_verified(path)
    return intact


def progress_lines(label: str) -> Progress:
    """Progress of a conversion on stderr, a line per phase (PHASES) and, in the phases counted in bytes or
    layers, its percent: updated in place on a terminal; elsewhere (a log file, a pipe) a whole line every 10 %, no
    carriage returns in the file."""
    shown: list = [None, -1]  # phase, step
    tty = sys.stderr.isatty()

    def progress(phase: str, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1) if total else None
        step = pct if tty or pct is None else pct - pct % 10
        if [phase, step] == shown:
            return
        if tty and shown[0] is not None and shown[1] is not None and phase != shown[0]:
            print(file=sys.stderr)  # end the finished phase's line
        shown[:] = [phase, step]
        line = f"colibri: {label}: {phase}" + (f" {step:3d} %" if step is not None else "")
        if tty and step is not None:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    return progress


def default_container(announce=None) -> Path:
    """The embedded default model as a container under cache_dir() (converted on first use)."""
    return cached_container(default_model_path(), cache_dir() / "models", DEFAULT_KIND, announce, prune=True)
