"""Models by name: the containers Colibri manages (`cache_dir()/models`, where the default model's container is
converted on first use), listed and removed by name (`colibri list`, `colibri rm`), and `--model` read as a path,
a listed name or a Hugging Face hub id. The default model's conversion on first use also removes the containers of
earlier copies of its file that are gone or changed (pipeline.cached_container's prune).

A hub id (`Qwen/Qwen2.5-0.5B-Instruct`, or `org/repo:Q4_K_M` for one GGUF file of a GGUF repository) resolves
through huggingface_hub's cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub): what is cached is
used as it is, what is missing is downloaded (the weights, configs and tokenizer of an HF repository; only the
named GGUF file of a GGUF one). With HF_HUB_OFFLINE=1 nothing is downloaded: a missing id is a one-line error
naming it. The hub id is resolved to a local path before anything loads, so the rest of Colibri sees a path.

A container remembers its source in its manifest (`source`: kind, path, fingerprint); a source inside the hub
cache is shown as its hub id. When every checksum of a managed container has passed (`colibri verify`, or the check
of a converted-on-first-use container at its first start), `NAME.verified` beside it records when and the
container's identity (`identity`): later starts trust a container whose identity is unchanged without reading it
whole (pages are still checked on first read); a container written after that (converted again) is not verified
by it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from colibri.core.defaults import cache_dir
from colibri.core.errors import InputError

# org/name[:QUANT], as the hub spells repository ids (a path that exists is never read as one)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[\w.-]+))?")
# what an HF repository's model needs (not its .bin, .pth, ONNX or GGUF copies of the same weights)
HF_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]
# a path inside the hub cache: a snapshot (a directory, or a file in it) or a blob (where a file's link resolves)
_HUB_PATH = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/"
                       r"(?:snapshots/[^/]+(?:/(?P<file>.+))?|(?P<blob>blobs)/.+)$")


def models_root() -> Path:
    return cache_dir() / "models"


@dataclass
class Managed:
    name: str
    path: Path
    source: str  # the hub id, else the source's path (what the manifest recorded)
    size: int  # bytes on disk
    kinds: list[str]  # the tensors' kinds (f32, bf16, q4, q4k, ...)
    created: float  # the manifest's mtime (seconds since the epoch)
    verified: float | None  # when every checksum last passed (None: not since it was written)

    def as_dict(self) -> dict:
        return {"name": self.name, "path": str(self.path), "source": self.source, "size": self.size,
                "kinds": self.kinds, "created": self.created, "verified": self.verified}


def listed() -> list[Managed]:
    """The managed containers, by name (a directory under models_root() holding a manifest)."""
    root = models_root()
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        manifest = d / "manifest.json"
        if not manifest.is_file():
            continue  # a conversion's work directory or a lock file
        try:
            m = json.loads(manifest.read_text())
            source = describe_source(m.get("source") or {})
            kinds = sorted({t["kind"] for t in m.get("tensors", [])})
        except (OSError, ValueError, TypeError, KeyError):
            source, kinds = "(unreadable manifest: colibri verify it, or colibri rm it)", []
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        created = manifest.stat().st_mtime
        mark = root / f"{d.name}.verified"
        verified = mark.stat().st_mtime if mark.is_file() else None
        out.append(Managed(d.name, d, source, size, kinds, created,
                           verified if verified is not None and verified >= created else None))
    return out


def identity(path: Path) -> list:
    """What a verified container must still be for a later start to trust it: the manifest's and every data file's
    name, size and mtime (ns). A rewrite, a copy over it or a truncation changes one of them; the side files
    (tokenizer, chat template, GGUF metadata) are checked against the manifest's checksums whenever they are read,
    and files written beside the data later (usage.json, tune.json) are not part of it."""
    files = [f for f in Path(path).iterdir() if f.name == "manifest.json" or (f.name.startswith("data-") and
                                                                               f.suffix == ".bin")]
    return sorted([f.name, st.st_size, st.st_mtime_ns] for f in files for st in [f.stat()])


def mark_verified(path: Path) -> None:
    """Record that every checksum of the container at `path` passed, with its identity, if it is a managed one
    (others: nothing is written). A cache that cannot be written only loses the record."""
    path = Path(path).resolve()
    root = models_root().resolve()
    if path.parent != root:
        return
    try:
        record = {"at": time.time(), "identity": identity(path)}
        (root / f"{path.name}.verified").write_text(json.dumps(record) + "\n")
    except OSError:
        pass


def trusted(path: Path) -> bool:
    """Whether the managed container at `path` was verified whole and is, by its identity, the same files since:
    a later start trusts it without reading every page again (each page is still checked on first read)."""
    path = Path(path).resolve()
    try:
        record = json.loads((path.parent / f"{path.name}.verified").read_text())
        return isinstance(record, dict) and record.get("identity") == identity(path)
    except (OSError, ValueError):
        return False


def describe_source(source: dict) -> str:
    path = str(source.get("path") or "?")
    hub = _HUB_PATH.search(path)
    if hub is None:
        return path
    repo = f"{hub['org']}/{hub['name']}"
    if hub["blob"]:
        return f"{repo} (a file of it)"
    return f"{repo} ({hub['file']})" if hub["file"] else repo


def remove(name: str) -> Path:
    """Delete the managed container `name` (InputError if there is none by that name)."""
    root = models_root()
    d = root / name
    if not name or "/" in name or name.startswith(".") or not (d / "manifest.json").is_file():
        raise InputError(f"no managed model named {name!r} in {root}; `colibri list` shows them")
    shutil.rmtree(d)
    (root / f"{name}.lock").unlink(missing_ok=True)
    (root / f"{name}.verified").unlink(missing_ok=True)
    return d


def resolve(model: str) -> str:
    """`--model` as a local path: a path that exists, a listed name, or a hub id (downloaded where missing and
    online); anything else as given (the loader's error names the missing path)."""
    if os.path.exists(model):
        return model
    if "/" not in model and (models_root() / model / "manifest.json").is_file():
        return str(models_root() / model)
    m = HUB_ID.fullmatch(model)
    if m is None or model.startswith("."):
        return model
    return str(hub_path(m["repo"], m["quant"]))


def hub_cache() -> Path:
    """huggingface_hub's cache directory, read from the environment now (its own constants are read when it is
    imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                     os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home) / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_path(repo: str, quant: str | None) -> Path:
    """The local path of a hub model: an HF repository's snapshot directory, or the GGUF file of `quant`."""
    ref = f"{repo}:{quant}" if quant else repo
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise InputError(f"--model {ref}: not a path or a listed model; a Hugging Face hub id needs huggingface_hub:"
                         " pip install 'colibri[hub]'") from None
    offline, cache = hub_offline(), hub_cache()
    patterns = [f"*{quant.lower()}*.gguf", f"*{quant.upper()}*.gguf"] if quant else HF_FILES
    try:
        snapshot = Path(snapshot_download(repo, allow_patterns=patterns, cache_dir=cache, local_files_only=offline))
    except LocalEntryNotFoundError:
        how = "the hub is offline (HF_HUB_OFFLINE)" if offline else "it could not be downloaded"
        raise InputError(f"--model {ref}: not a path, not a listed model, and not in the Hugging Face cache {cache}"
                         f" ({how}); download it once online, or give a path") from None
    except RepositoryNotFoundError:
        raise InputError(f"--model {ref}: no such model on the Hugging Face hub (a private one needs `hf auth"
                         " login`); or give a path") from None
    except (HfHubHTTPError, OSError) as e:
        raise InputError(f"--model {ref}: downloading from the Hugging Face hub failed ({e}); check the network,"
                         " or give a path") from None
    ggufs = sorted(p for p in snapshot.rglob("*.gguf") if p.is_file() or p.is_symlink())
    if quant:
        found = [p for p in ggufs if quant.lower() in p.name.lower()]
        if len(found) != 1:
            named = ", ".join(p.name for p in ggufs) or "none"
            raise InputError(f"--model {ref}: {len(found)} GGUF files of {repo} match {quant} (cached: {named});"
                             " name one quantization that one file has")
        return found[0]
    if not (snapshot / "config.json").is_file():
        raise InputError(f"--model {ref}: {repo} has no config.json; for a GGUF repository name a file's"
                         f" quantization, e.g. {repo}:Q4_K_M")
    return snapshot
