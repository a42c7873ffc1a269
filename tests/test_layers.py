"""The package's structure: no import cycles, every module importable on its own, one checkpoint protocol."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import colibri
import real_models
from colibri.convert import pipeline as conv
from colibri.formats.container import PageEntry, TensorEntry, plan_layout
from colibri.formats.checkpoint import Checkpoint, open_checkpoint
from colibri.models import open_model

PACKAGE = Path(colibri.__file__).parent


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """module -> the colibri modules it imports when it runs: at module level or inside a function (an import
    deferred into a function still closes a cycle at run time); `if TYPE_CHECKING:` blocks only when typing."""
    mods = modules()

    def owner(name: str) -> str | None:  # `from colibri.x import y`: y is a module or a name in colibri.x
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = set() if typing else {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        targets = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {o for t in targets if t.startswith("colibri") and (o := owner(t)) not in (None, name)}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 30 and "colibri.runtime.model" in graph["colibri.cli"]  # a deferred import counts
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_kv_modules_form_no_cycle_with_type_only_imports():
    """kv/ gives each state one owner (swap file, pool with its blocks and tables, sequence cache, prefix trie,
    space, sessions), so its modules import one way even counting `if TYPE_CHECKING:` imports."""
    kv = {a: {b for b in targets if b.startswith("colibri.kv.")}
          for a, targets in import_graph(typing=True).items() if a.startswith("colibri.kv.")}
    assert {"colibri.kv.pool", "colibri.kv.cache", "colibri.kv.prefix", "colibri.kv.space"} <= set(kv)
    assert "colibri.kv.cache" in kv["colibri.kv.prefix"]  # edges are found
    assert cycle(kv) is None, " -> ".join(cycle(kv))


def test_every_module_imports_on_its_own():
    """Each module imported first, in an interpreter where no other colibri module is loaded yet (an import-order
    dependence or a cycle that a fixed order hides fails here)."""
    code = ("import sys, importlib\n"
            "for name in sys.argv[1:]:\n"
            "    for m in [m for m in sys.modules if m == 'colibri' or m.startswith('colibri.')]:\n"
            "        del sys.modules[m]\n"
            "    importlib.import_module(name)\n")
    names = [n for n in modules() if n != "colibri.__main__"]
    p = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


# -- the checkpoint protocol -------------------------------------------------------------------------------


PROTOCOL = [n for n in vars(Checkpoint) if not n.startswith("_")] + list(Checkpoint.__annotations__)


def check_protocol(ckpt, fmt: str) -> None:
    for name in PROTOCOL:
        assert hasattr(ckpt, name), f"{type(ckpt).__name__} lacks {name}"
    assert ckpt.format == fmt
    for name in [n for n in vars(Checkpoint) if not n.startswith("_") and callable(vars(Checkpoint)[n])]:
        want = list(inspect.signature(vars(Checkpoint)[name]).parameters)
        assert list(inspect.signature(getattr(type(ckpt), name)).parameters) == want, name


@pytest.fixture(scope="module")
def container(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("layers") / "c"
    conv.convert(tiny_model_dir("qwen2_moe"), out, conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))
    return out


def test_every_reader_offers_the_protocol(tiny_model_dir, container):
    import torch

    sources = [(tiny_model_dir("qwen2_moe"), "huggingface", torch.float32), (container, "container", torch.bfloat16)]
    gguf = real_models.smollm2_gguf()
    if gguf is not None:
        sources.append((gguf, "gguf", torch.float32))
    for path, fmt, dtype in sources:
        ckpt = open_checkpoint(path)
        try:
            check_protocol(ckpt, fmt)
            assert ckpt.default_dtype() == dtype
            name = min(ckpt.tensor_names(), key=lambda n: math.prod(ckpt.tensor_shape(n)))
            assert tuple(ckpt.load(name).shape) == ckpt.tensor_shape(name)
        finally:
            ckpt.close()


def test_manifest_records_read_back_as_the_written_dataclasses(tiny_model_dir, container):
    ckpt, args, decoder = open_model(container)
    try:
        tensors, pages, _ = plan_layout(decoder.weight_shapes(), args.tie_word_embeddings, "q4", 32, 1 << 20)
        assert all(type(t) is TensorEntry for t in ckpt.tensors.values())
        assert all(type(p) is PageEntry for p in ckpt.pages)
        # equal to what the writer planned, once the checksums it filled in while writing are set aside
        assert [dataclasses.replace(ckpt.tensors[t.name], checksum="") for t in tensors] == tensors
        assert [dataclasses.replace(p, checksum="") for p in ckpt.pages] == pages
        manifest = json.loads((container / "manifest.json").read_text())
        assert [dataclasses.asdict(t) for t in ckpt.tensors.values()] == manifest["tensors"]
        t = next(iter(ckpt.tensors.values()))
        with pytest.raises(TypeError):  # read by attribute only: a key access fails loudly
            t["kind"]
        assert not hasattr(t, "get")
    finally:
        ckpt.close()


# The layers, bottom up: the one place their order is written (README and docs/architecture.md point here). A
# layer is a folder of src/colibri (a package and everything under it); "" is the top: the modules at the root,
# the surfaces. A module imports only modules of its own layer or below, type-only imports included, and every
# folder is placed (a new one fails here until it is).
LAYERS = ["core", "kernels", "quant", "formats", "weights", "models", "convert", "kv", "engine", "runtime", "perf",
          "server", ""]


def layer_of(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "")


def test_every_folder_has_a_layer():
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders == set(LAYERS) - {""}, folders ^ (set(LAYERS) - {""})


def test_no_layer_reaches_up():
    """Module edges, type-only imports included, never climb: so the folders form no cycle."""
    up = [f"{a} -> {b}" for a, targets in import_graph(typing=True).items() for b in sorted(targets)
          if layer_of(b) > layer_of(a)]
    assert not up, up


def test_layer_of():
    assert layer_of("colibri.core.errors") == 0 and layer_of("colibri.weights.streaming.store") == 4
    assert layer_of("colibri.kernels") == 1 and layer_of("colibri.cli") == layer_of("colibri") == len(LAYERS) - 1
