"""`EngineConfig`: every setting of a loaded model and its engine, with every default, in one place.

The CLI builds one from its options (`cli.OPTIONS` take their defaults from here), `colibri.load(path, **kw)`
builds one from keywords, and `load`, `plan`, `bench` and the memory budget read it. Sizes (`memory_limit`,
`kv_ram`) are bytes or strings such as "600M" / "2G"; `memory_limit_bytes` and `kv_ram_bytes` give them as bytes.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

from colibri.core.errors import InputError

DEFAULT_MAX_TOKENS = 256  # tokens a request generates unless told otherwise (CLI and Python alike)
DEFAULT_BATCH = 512  # tokens per forward pass: a long prompt is prefilled in chunks of it
DEFAULT_MAX_SEQUENCES = 16  # sequences decoded together in one step
DEFAULT_IO_THREADS = 2
DEFAULT_NGRAM = 4  # speculation: the longest n-gram a draft is matched on
DEFAULT_NGRAM_CACHE = 1 << 16  # n-grams in the cache shared by all sequences
MAX_DRAFT_TOKENS = 64


@dataclass
class EngineConfig:
    """model: a container, HF directory or .gguf file (None: the embedded default model).
    memory_limit: bound on weights, staging, KV and activations (containers only; None: all in RAM).
    dtype: compute dtype ("float32" / "bfloat16"; None: the checkpoint's). threads: compute threads (None:
    torch's choice). io_threads / prefetch_depth: the streaming reader (None depth: one layer's pages plus one).
    ctx_length: the longest sequence in tokens (None: the model's, or under a limit one whose KV fits).
    batch_size: tokens per forward pass, all sequences together. max_sequences: sequences running at once.
    kv_ram: RAM for the KV pool (all sequences and cached prefixes; None: the whole context, under a limit a
    share of it). kv_quant: None or "q8" (lossy). kv_block: tokens per KV block, the unit of the swap file, the
    prefix cache and saved sessions (None: chosen per model, 16 to 64: kv.block_for). swap: a swap file made by
    `colibri swap create`; swap_dir: where a temporary one is made otherwise (None: ~/.cache/colibri/swap).
    draft_tokens: speculative decoding's draft length (None: adaptive, sized by measured acceptance and pass
    cost; 0: off; N: N whenever an n-gram matches). ngram: the longest n-gram matched. ngram_cache_size: entries
    of the n-gram cache shared by all sequences (0: prompt lookup only). lookahead: MoE under a memory limit,
    predict the next layer's experts with its router and read them early (never changes tokens).
    lossy_int8_activations: LOSSY, q4 / q8 / q4k / q8k linears quantize activations to int8 per row and group (every
    native tier: AVX-512 VNNI, AVX2, portable; cost in docs/quality.md and docs/performance.md); this model's own
    (its passes run in it; without it, COLIBRI_LOSSY_INT8 decides: colibri.kernels). chat_template: a Jinja file
    that replaces the model's chat template (None: the model's own). sparse_ffn: LOSSY, None (off) or the sparse-FFN
    sidecar of `colibri calibrate` ("default": the container's own): a dense FFN neuron whose |act(gate)| is at or
    below its layer's calibrated threshold is skipped for that token (runtime/sparsity.py; cost in
    docs/quality.md)."""

    model: str | os.PathLike | None = None
    memory_limit: int | str | None = None
    dtype: Any = None
    threads: int | None = None
    io_threads: int = DEFAULT_IO_THREADS
    prefetch_depth: int | None = None
    ctx_length: int | None = None
    batch_size: int = DEFAULT_BATCH
    max_sequences: int = DEFAULT_MAX_SEQUENCES
    kv_ram: int | str | None = None
    kv_quant: str | None = None
    kv_block: int | None = None
    swap: str | os.PathLike | None = None
    swap_dir: str | os.PathLike | None = None
    draft_tokens: int | None = None
    ngram: int = DEFAULT_NGRAM
    ngram_cache_size: int = DEFAULT_NGRAM_CACHE
    lookahead: bool = True
    lossy_int8_activations: bool = False
    chat_template: str | os.PathLike | None = None
    sparse_ffn: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_sequences", "io_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1 (got {v!r})")
        for name in ("threads", "ctx_length"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InputError(f"--{name.replace('_', '-')} must be at least 1 (got {v!r})")
        if self.draft_tokens is not None and (not isinstance(self.draft_tokens, int)
                                              or not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS):
            raise InputError(f"--draft-tokens must be between 0 and {MAX_DRAFT_TOKENS} (got {self.draft_tokens!r});"
                             " leave it out for the adaptive length")
        if not isinstance(self.ngram, int) or not 1 <= self.ngram <= 16:
            raise InputError(f"--ngram must be between 1 and 16 (got {self.ngram!r})")
        if not isinstance(self.ngram_cache_size, int) or self.ngram_cache_size < 0:
            raise InputError(f"--ngram-cache-size must be at least 0 (got {self.ngram_cache_size!r})")
        if self.prefetch_depth is not None and (not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0):
            raise InputError(f"--prefetch-depth must be at least 0 (got {self.prefetch_depth!r})")

    @classmethod
    def from_kwargs(cls, model=None, **kwargs: Any) -> "EngineConfig":
        """A config from keyword arguments (those of `colibri.load`); an unknown one is a clear error."""
        names = {f.name for f in fields(cls)}
        bad = sorted(set(kwargs) - names)
        if bad:
            raise InputError(f"unknown option(s) {', '.join(bad)}; known: {', '.join(sorted(names))}")
        return cls(model=model, **{k: v for k, v in kwargs.items() if v is not None})

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        """A config from parsed CLI options (an argparse namespace): the options a subcommand has, by name."""
        kw = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        return cls(**kw)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def memory_limit_bytes(self) -> int | None:
        from colibri.core.defaults import parse_size
        return None if self.memory_limit is None else parse_size(self.memory_limit)

    @property
    def kv_ram_bytes(self) -> int | None:
        from colibri.core.defaults import parse_size
        return None if self.kv_ram is None else parse_size(self.kv_ram)

    def model_path(self):
        from pathlib import Path
        if self.model is not None:
            if not isinstance(self.model, (str, os.PathLike)):
                raise InputError(f"the model must be a path (a container, an HF directory or a .gguf file; got"
                                 f" {type(self.model).__name__})")
            return Path(self.model)
        from colibri.core.defaults import default_model_path
        return Path(default_model_path())
