"""A GGUF that stores a tied model's table twice (llama.cpp writes `output.weight` for Qwen2.5 although the HF
model ties it to `token_embd.weight`, often at another precision): found, so that a quantized container stores
the table once and reads it both as the lookup (rows) and as the head (row blocks).

Two quantizations of one matrix differ only by their rounding error, a relative RMS difference far below
TIE_TOLERANCE; an untied model's head and embedding are unrelated matrices, far above it (figures:
docs/quality.md, "Reading the table"). The single table is made from the one with more bytes (the finer).
"""

from __future__ import annotations

import torch

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TIE_TOLERANCE = 0.25  # relative RMS difference below which the two tables are one matrix
SAMPLE_BLOCKS, SAMPLE_ROWS = 64, 32  # the rows compared: 64 evenly spaced blocks of 32


def _sample_starts(n: int) -> range:
    """First rows of the SAMPLE_BLOCKS blocks of SAMPLE_ROWS rows spread evenly over n rows (all of them when n is
    small)."""
    if n <= SAMPLE_BLOCKS * SAMPLE_ROWS:
        return range(0, n, SAMPLE_ROWS)
    return range(0, n - SAMPLE_ROWS + 1, (n - SAMPLE_ROWS) // (SAMPLE_BLOCKS - 1))


def tied_table_source(ckpt) -> str | None:
    """For a GGUF checkpoint holding both tables as quantizations of one matrix: the name of the finer one.
    None when the checkpoint has one table, or two different ones.

    The two are compared on evenly spaced blocks of rows, not whole: quantizations of one matrix differ by rounding
    noise in every row, unrelated matrices in every row, so a few thousand rows decide it with the same margin as
    all of them (dequantizing two 150k-row tables whole took most of a 1.5B model's conversion time and two f32
    copies of the table in RAM)."""
    names = set(ckpt.tensor_names())
    if ckpt.format != "gguf" or HEAD not in names or EMBED not in names:
        return None
    shape = tuple(ckpt.tensor_shape(HEAD))
    if shape != tuple(ckpt.tensor_shape(EMBED)):
        return None
    diff = norm = 0.0
    for r in _sample_starts(shape[0]):
        a = ckpt.load_rows(EMBED, r, r + SAMPLE_ROWS).double()
        b = ckpt.load_rows(HEAD, r, r + SAMPLE_ROWS).double()
        diff += float(((a - b) ** 2).sum())
        norm += float((a ** 2).sum())
    if diff > TIE_TOLERANCE ** 2 * norm:
        return None
    return HEAD if ckpt.stored_nbytes(HEAD) >= ckpt.stored_nbytes(EMBED) else EMBED


class TiedTable:
    """A checkpoint seen with one table: `model.embed_tokens.weight` reads `source`, `lm_head.weight` is gone."""

    def __init__(self, ckpt, source: str):
        self._ckpt, self._source = ckpt, source
        self.config = dict(ckpt.config, tie_word_embeddings=True)

    def __getattr__(self, name: str):
        return getattr(self._ckpt, name)

    def _name(self, name: str) -> str:
        return self._source if name == EMBED else name

    def tensor_names(self) -> list[str]:
        return [n for n in self._ckpt.tensor_names() if n != HEAD]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._ckpt.tensor_shape(self._name(name))

    def tensor_dtype(self, name: str) -> str:
        return self._ckpt.tensor_dtype(self._name(name))

    def load(self, name: str) -> torch.Tensor:
        return self._ckpt.load(self._name(name))

    def raw_tensor(self, name: str, copy: bool = True):
        return self._ckpt.raw_tensor(self._name(name), copy)

    def release(self, name: str) -> None:
        self._ckpt.release(self._name(name))
