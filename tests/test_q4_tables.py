"""q4 token embeddings and heads: a tied table stored once serves the lookup (rows) and the head (row blocks)."""

from __future__ import annotations

import json

import pytest
import torch

import colibri
import colibri.runtime.model
import tiny_models
from colibri.convert import pipeline as conv
from colibri.weights import placement
from colibri.runtime.model import open_model

PROMPT = tiny_models.token_ids(12, 384, seed=3)
EMBED = "model.embed_tokens.weight"
Q4_EMBED = {EMBED: ("q4", 32)}


def tight(path, dtype, batch_size=1) -> int:
    """A limit at the container's minimum: every table is read by rows / row blocks."""
    placement, _, _ = colibri.runtime.model.plan(path, None, dtype=dtype, batch_size=batch_size)
    return placement.minimum


def untied_storage(src, dst, opts) -> None:
    """The same tied model written the old way: the table stored twice, as the embedding and as lm_head."""
    ckpt, args, decoder = open_model(src)
    shapes = dict(decoder.weight_shapes(), **{"lm_head.weight": decoder.weight_shapes()[EMBED]})
    kinds = {EMBED: ("q4", 32), "lm_head.weight": ("q4", 32)}

    def encode(entry):
        w = ckpt.load(EMBED if entry.name == "lm_head.weight" else entry.name)
        return conv.quant.quantize(w.float(), entry.kind, entry.group_size) if entry.kind in ("q4", "q8") else w

    config = dict(ckpt.config, tie_word_embeddings=False)
    conv.write_container(dst, config, shapes, False, opts, encode, "untied", {"kind": "huggingface"},
                         lambda work: conv.tokenizer_files(ckpt, work), kinds=kinds)
    ckpt.close()


@pytest.fixture(scope="module")
def tied_pair(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("q4tables")
    opts = conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1)
    src = tiny_model_dir("llama_tied")
    conv.convert(src, root / "tied", opts, kinds=Q4_EMBED)
    untied_storage(src, root / "untied", opts)
    return root / "tied", root / "untied"


def test_tied_table_is_stored_once(tied_pair):
    tied, untied = tied_pair
    names = [t["name"] for t in json.loads((tied / "manifest.json").read_text())["tensors"]]
    assert names.count(EMBED) == 1 and "lm_head.weight" not in names
    kinds = {t["name"]: t["kind"] for t in json.loads((untied / "manifest.json").read_text())["tensors"]}
    assert kinds[EMBED] == kinds["lm_head.weight"] == "q4"
    size = lambda p: sum(f["size"] for f in json.loads((p / "manifest.json").read_text())["files"])
    assert size(tied) < size(untied)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tied_logits_equal_untied_storage(tied_pair, monkeypatch, dtype):
    """Resident and streamed (rows for the lookup, row blocks for the head), tied storage computes the same
    logits as the table stored twice."""
    monkeypatch.setattr(placement, "BLOCK_BYTES", 4096)  # tiny tables: several head blocks...
    monkeypatch.setattr(placement, "HEAD_BUFFERS", 1)  # ...through buffers smaller than the 16 KiB table
    tied, untied = tied_pair
    want = colibri.load(untied, dtype=dtype, batch_size=1).logits(PROMPT)
    for path in (tied, untied):
        assert torch.equal(colibri.load(path, dtype=dtype, batch_size=1).logits(PROMPT), want)
        m = colibri.load(path, dtype=dtype, memory_limit=tight(path, dtype), prefetch_depth=0, batch_size=1)
        by_rows = {m.checkpoint.pages[i].kind for i in m.store.placement.by_rows}
        assert "embedding" in by_rows and (path == tied or "head" in by_rows)
        assert torch.equal(m.logits(PROMPT), want)
        assert m.store.stats.row_bytes_read > 0


def test_q4_row_lookup_equals_dequantize_then_index(tied_pair, monkeypatch):
    monkeypatch.setattr(placement, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(placement, "HEAD_BUFFERS", 1)
    tied, _ = tied_pair
    table = colibri.load(tied, dtype="float32").store.get(EMBED)
    assert table.kind.name == "q4"
    ids = torch.tensor([0, 383, 64, 65, 63, 200, 0, 320, 319])  # tile edges, the last tile, a repeat
    want = table.dequantize()[ids]
    assert torch.equal(table.rows(ids), want)
    m = colibri.load(tied, dtype="float32", memory_limit=tight(tied, "float32"), prefetch_depth=0, batch_size=1)
    assert m.store.placement.by_rows
    assert torch.equal(m.store.rows(EMBED, ids), want)  # tiles read from disk, the rows picked from them
    assert m.store.stats.row_bytes_read < m.checkpoint.tensors[EMBED].nbytes + 4096
