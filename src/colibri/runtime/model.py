"""`colibri.load` and the Model object: one checkpoint, one weight store, one family's math."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch

from colibri import kernels
from colibri.core import heap
from colibri.core.config import EngineConfig
from colibri.core.errors import InputError, UnsupportedModelError
from colibri.core.metrics import rss_bytes
from colibri.engine.memory import PassShape
from colibri.engine.request import token_ids
from colibri.engine import Engine
from colibri.engine import generate as gen
from colibri.engine.sampling import warm_up as warm_sampler
from colibri.formats.checkpoint import Checkpoint, check_tensors
from colibri.formats.container import ContainerCheckpoint
from colibri.formats.tokenizer import Tokenizer
from colibri.kv.cache import KVCache
from colibri.kv.space import KVSpace
from colibri.models import open_model
from colibri.models.base import SLIDING
from colibri.quant.kinds import QUANT_KINDS_ALL
from colibri.runtime import budget, warmup
from colibri.weights.store import RamStore

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype not in (None, torch.float32, torch.bfloat16):
            raise UnsupportedModelError(f"compute dtype {dtype} is not supported (use float32 or bfloat16)")
        return dtype
    if str(dtype).lower() not in DTYPES:
        raise UnsupportedModelError(f"compute dtype {dtype!r} is not supported (use float32 or bfloat16)")
    return DTYPES[str(dtype).lower()]


def weights_floor(ckpt: Checkpoint, args, memory_limit, batch: int) -> int | None:
    """The staging a container's weights need at the least under a limit (None: no limit, or not a container:
    nothing streams)."""
    if memory_limit is None or not isinstance(ckpt, ContainerCheckpoint):
        return None
    from colibri.weights.placement import WeightTable, minimum_staging
    return minimum_staging(WeightTable.of(ckpt, args), batch)


MIN_PASS = 16  # the shortest pass (prefill chunk) a tight memory limit falls back to


def fitted_settings(ckpt: Checkpoint, args, dtype: torch.dtype, config: EngineConfig) -> tuple[budget.Settings, int]:
    """The memory settings and the tokens per pass: --batch-size, or, under a limit that leaves too little for
    a pass of that many tokens, the largest halving of it (down to MIN_PASS) that fits: a long prefill then runs
    in shorter chunks instead of being refused. A limit too small even for those is refused, stating the minimum
    found with the shortest pass."""
    batch = config.batch_size
    while True:
        last = config.memory_limit is None or batch <= MIN_PASS
        try:
            conf = budget.settings(args, dtype, dataclasses.replace(config, batch_size=batch), quantized(ckpt),
                                   weights_floor(ckpt, args, config.memory_limit, batch), state_minimum=last)
            return conf, batch
        except InputError:
            if last:
                raise
            batch = max(MIN_PASS, batch // 2)


def quantized(ckpt: Checkpoint) -> bool:
    return isinstance(ckpt, ContainerCheckpoint) and ckpt.quantized


def policy_entry(key: str, value) -> str:
    """One entry of a container's quantization policy as `info` prints it."""
    if key == "mixed":  # a calibrated conversion's measured mix
        return (f"mixed={value['mix']} ({len(value['q8'])} tensors q8, {value['bits_per_weight']} bits/weight,"
                f" calibrated on {value['calibration']['tokens']} tokens)")
    if key == "gguf_exact":  # GGUF block types kept exactly, and the kind each became
        return "kept exactly: " + ", ".join(f"{t}->{k}" for t, k in value.items())
    if isinstance(value, dict):
        return f"{key}={value['kind']} ({', '.join(n.strip('.') for n in value['names'])})"
    return f"{key}={value}"


def describe(path: str | Path) -> dict[str, str]:
    """What `colibri info` prints: architecture, size, storage types, tokenizer, context length."""
    path = Path(path)
    ckpt, args, decoder = open_model(path)
    shapes = decoder.weight_shapes()
    params = sum(math.prod(s) for s in shapes.values())
    kinds = Counter(ckpt.tensor_dtype(n) for n in shapes)
    tok = ckpt.tokenizer
    info = {
        "path": str(path),
        "format": {"gguf": "gguf", "huggingface": "huggingface directory"}.get(ckpt.format, ckpt.format),
        "architecture": args.model_type,
        "parameters": f"{params:,} ({params / 1e9:.2f} B)",
        "layers": f"{args.num_layers} (hidden {args.hidden_size}, heads {args.num_heads}/{args.num_kv_heads} kv,"
                  f" head dim {args.head_dim})",
        "storage": ", ".join(f"{k} x{v}" for k, v in kinds.most_common()),
        "experts": f"{args.num_experts} (top {args.top_k})" if args.num_experts else "none (dense)",
        "tokenizer": f"{tok.get_vocab_size()} tokens" if tok is not None else "none",
        "chat template": "yes" if ckpt.chat_template else "no",
        "context length": str(args.max_position_embeddings),
    }
    if isinstance(ckpt, ContainerCheckpoint):
        mf = ckpt.manifest
        disk = sum(f["size"] for f in mf["files"])
        info["format"] = f"colibri container v{mf['version']}"
        info["size on disk"] = f"{disk / 2**20:.1f} MiB ({8 * disk / params:.2f} bits/weight)"
        info["pages"] = f"{len(mf['pages'])} (target {mf['page_size'] >> 20} MiB)"
        q = mf["quant"]
        info["quantization"] = f"{q['kind']} group {q['group_size']}; policy " + ", ".join(
            policy_entry(k, v) for k, v in q["policy"].items())
    ckpt.close()
    return info


# kinds the int8 kernels take: their group of x (None: the weight's). The other GGUF kinds kept as blocks stay
# exact in the LOSSY int8 mode (quant.kinds._BlocksWeight says why).
INT8_KINDS = {"q4": None, "q8": None, "q4k": 32, "q8k": 16, "q4_1": 32, "q4_0": 32, "q6k": 16, "q3k": 16,
              "iq4_xs": 16}


def int8_shortfall(ckpt: Checkpoint, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Where the LOSSY int8 kernels leave some of this model's linear weights exact, a phrase saying which and
    why (None: they take every quantized one). Only a container holds quantized weights; the others compute
    in floats."""
    if not isinstance(ckpt, ContainerCheckpoint):
        return (f"do not apply to a {ckpt.format} checkpoint (its weights compute in floats); convert it to a"
                " quantized container (colibri convert) to use them; running exact")
    taken, left, blocks = 0, [], Counter()
    for name in shapes:
        t = ckpt.tensors[name]
        if t.kind not in INT8_KINDS:
            if t.kind in QUANT_KINDS_ALL:
                blocks[t.kind] += 1
            continue
        group = INT8_KINDS[t.kind] or t.group_size
        if kernels.int8_supports(t.shape[1], group):
            taken += 1
        else:
            left.append(name)
    if not taken:
        return (f"do not apply: this container has no {'/'.join(INT8_KINDS)} weights that they can take; running"
                " exact")
    why = []
    if blocks:
        why.append(", ".join(f"{k} x{v}" for k, v in blocks.most_common()) + ": no int8 kernel reads those GGUF"
                   " blocks")
    if left:
        why.append(f"K not a multiple of 64 or an unsupported group size: {left[0]}{', ...' if len(left) > 1 else ''}")
    if why:
        n = len(left) + sum(blocks.values())
        return f"leave {n} of {taken + n} quantized weights exact ({'; '.join(why)})"
    return None


class Model:
    """One loaded checkpoint: its weight store, KV space and the engine that runs every request on them."""

    pass_bytes = None  # under a memory limit: (tokens, ctx, logit rows) -> bytes a pass needs besides weights and KV

    def __init__(self, config: EngineConfig):
        self.config = config
        self.closed = False
        if config.threads:
            torch.set_num_threads(int(config.threads))
        self.path = config.model_path()
        self.checkpoint, self.args, self.decoder = open_model(self.path)
        # the model's own mode (its passes run in it, whatever other models of the process do); without the option,
        # the process's setting (COLIBRI_LOSSY_INT8)
        self.decoder.lossy_int8 = True if config.lossy_int8_activations else None
        ckpt = self.checkpoint
        self.dtype = resolve_dtype(config.dtype) or ckpt.default_dtype()
        shapes = self.decoder.weight_shapes()
        check_tensors(ckpt, shapes, self.path)
        with kernels.int8_mode(self.decoder.lossy_int8):
            lossy = kernels.int8_activations()  # requested and the tier has them (where not, kernels said why)
        if lossy:
            why = int8_shortfall(ckpt, shapes)
            if why:
                kernels.notice(f"lossy int8 activations {why}")
        self.tokenizer = self._tokenizer()
        self.max_sequences = config.max_sequences
        # tokens per pass: --batch-size, fewer when the limit is too tight for a pass of it
        conf, self.batch_size = fitted_settings(ckpt, self.args, self.dtype, config)
        self.context_length, self.reserve, self.kv_plan = conf.ctx, conf.reserve, conf.kv
        # the KV pool's RAM, shared by every sequence and the cached prefixes: bounded under a memory limit or
        # an explicit --kv-ram, else it grows as sequences need
        self.kv_pool_bytes = conf.kv.ram_bytes if conf.memory_limit is not None or config.kv_ram is not None else None
        swap, swap_dir, fallback = config.swap, config.swap_dir, None
        if swap is None and swap_dir is None:  # the cache's, else (an unwritable cache) the system's temporary one
            import tempfile
            from colibri.core.defaults import cache_dir
            swap_dir, fallback = cache_dir() / "swap", tempfile.gettempdir()
        a = self.args
        self.kv = KVSpace(conf.kv.layout, self.context_length, conf.kv.window, conf.kv.prefix_ram, swap, swap_dir,
                          [a.sliding_window if t == SLIDING else None for t in a.layer_types], config.io_threads,
                          sequences=config.max_sequences, swap_fallback=fallback)
        # Everything allocated so far (interpreter, torch and its kernels' first-use state, tokenizer, manifest)
        # is the runtime baseline, outside the memory limit; what follows (weights, staging, KV cache,
        # activations) is inside it.
        # (the miniature forward pass pages in the code the passes run: under a limit only, where the baseline
        # bounds the budget)
        warm = warmup.warm_up(self.dtype, self.decoder if conf.memory_limit is not None else None)
        if warm is not None:
            warm_sampler(*warm)
        heap.trim_heap()
        self.baseline_rss_bytes = rss_bytes()
        if conf.memory_limit is not None:
            if not isinstance(ckpt, ContainerCheckpoint):
                raise UnsupportedModelError(f"{self.path}: --memory-limit streams weights from a Colibri container;"
                                            " convert the model first (colibri convert --input ... --output ...)")
            from colibri.weights.streaming import StreamingStore
            heap.tame_allocator()
            self.store = StreamingStore(ckpt, self.args, conf.memory_limit, self.dtype,
                                        io_threads=config.io_threads, prefetch_depth=config.prefetch_depth,
                                        reserve=self.reserve.total, batch=self.batch_size,
                                        lookahead=config.lookahead, baseline=self.baseline_rss_bytes)
            # the elastic budget: what each pass needs beside the weights, so the store pins what the KV pool
            # and that pass leave of the limit
            self.pass_bytes = functools.partial(budget.pass_bytes, self.args, self.dtype, quantized(ckpt))
        elif isinstance(ckpt, ContainerCheckpoint):
            self.store = RamStore.load_container(ckpt, shapes, self.dtype)
        else:
            self.store = RamStore.load(shapes, ckpt.load, self.dtype)
        self.sparse = None  # --sparse-ffn's hook (LOSSY), counting what it kept
        if config.sparse_ffn is not None:
            from colibri.runtime import sparsity
            self.sparse = sparsity.attach(self, str(config.sparse_ffn))
        self.eos_ids = set(self.tokenizer.eos_ids if self.tokenizer else self.args.eos_token_id)
        self.engine = Engine(self.decoder, self.store, self.kv, tokenizer=self.tokenizer, eos_ids=self.eos_ids,
                             context=self.context_length, pass_tokens=self.pass_tokens,
                             max_sequences=self.max_sequences, pool_bytes=self.kv_pool_bytes,
                             pass_bytes=self.pass_bytes, config=config)
        # pin what a short pass leaves of the limit, before the first request
        self.engine.memory.make_room(0, PassShape(1, 1, 1))

    @property
    def pass_tokens(self) -> int:
        """Tokens per forward pass: --batch-size, less when the KV window is smaller."""
        w = self.kv_plan.window
        return self.batch_size if w is None else max(1, min(self.batch_size, w - self.kv_plan.layout.block))

    def _tokenizer(self) -> Tokenizer | None:
        ckpt = self.checkpoint
        if ckpt.tokenizer is None:
            return None
        sp = ckpt.special
        eos = sp.get("eos_token_id")
        eos = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        eos = list(eos) or self.args.eos_token_id
        strings = {k: sp.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        template = ckpt.chat_template
        if self.config.chat_template is not None:
            path = Path(self.config.chat_template)
            try:
                template = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"--chat-template {path}: cannot be read ({e}); give a Jinja template file")
        return Tokenizer(ckpt.tokenizer, eos, sp.get("bos_token_id"), template, strings)

    # -- forward passes --------------------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        """An empty cache of its own (not the live sequence, no prefix reuse)."""
        return self.kv.new_cache()

    def stats(self) -> dict:
        """Placement and cumulative I/O counters of the weight store, with the runtime baseline."""
        out = {"runtime_baseline_rss_bytes": self.baseline_rss_bytes, **self.reserve.as_dict(),
               **self.kv_plan.as_dict(), "kv_pool_bytes": self.kv_pool_bytes, **self.kv.counters(),
               **self.engine.counters()}
        if self.store.placement is not None:
            out.update(self.store.placement.as_dict())
        out.update(self.store.counters())  # {} when all is in RAM
        if self.sparse is not None:
            out.update(self.sparse.counters())
        return out

    @torch.inference_mode()
    def logits(self, token_ids) -> torch.Tensor:
        """float32 [len(token_ids), vocab]: one fresh full forward, no cached state kept."""
        return torch.cat(list(self.engine.score(self.prompt_ids(token_ids))))

    @torch.inference_mode()
    def embed(self, prompt) -> torch.Tensor:
        """float32 [D]: the prompt's embedding, the last token's final hidden state (after the model's last norm,
        the vector the LM head reads) scaled to length 1. The last token, not a mean: under causal attention it
        is the only one that has read the whole input (as decoder embedding models such as Qwen3-Embedding and
        e5-mistral pool); unit length, as OpenAI's embeddings have, so a dot product is the cosine."""
        last = list(self.engine.score(self.prompt_ids(prompt), hidden=True))[-1][-1]
        return torch.nn.functional.normalize(last.float(), dim=0)

    # -- generation ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise InputError(f"the model {self.path} is closed; load it again (colibri.load) to use it")

    def prompt_ids(self, prompt) -> list[int]:
        self._check_open()
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise InputError("the prompt is bytes; give text (e.g. prompt.decode('utf-8')) or a list of token ids")
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("empty prompt: give some text")
            if self.tokenizer is None:
                raise InputError(f"{self.path} has no tokenizer; pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        ids = token_ids(prompt)
        if not ids:
            raise InputError("empty prompt: give at least one token id")
        bad = [i for i in ids if not 0 <= i < self.args.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (size {self.args.vocab_size})")
        return ids

    def sampling_params(self, **sampling) -> gen.SamplingParams:
        try:
            return gen.SamplingParams(**sampling)
        except TypeError as e:
            raise InputError(f"unknown sampling option: {e}") from None

    def stream(self, prompt, **sampling) -> Iterator[gen.StreamChunk]:
        return gen.stream(self.engine, self.prompt_ids(prompt), self.sampling_params(**sampling))

    def generate(self, prompt, **sampling) -> gen.GenerationResult:
        return gen.generate(self.engine, self.prompt_ids(prompt), self.sampling_params(**sampling))

    def chat_ids(self, messages: list[dict]) -> list[int]:
        self._check_open()
        if self.tokenizer is None:
            raise InputError(f"{self.path} has no tokenizer; chat needs one")
        return self.tokenizer.encode_chat(messages)

    def chat(self, messages: list[dict], **sampling) -> gen.GenerationResult:
        return gen.generate(self.engine, self.chat_ids(messages), self.sampling_params(**sampling))

    def stream_chat(self, messages: list[dict], **sampling) -> Iterator[gen.StreamChunk]:
        return gen.stream(self.engine, self.chat_ids(messages), self.sampling_params(**sampling))

    # -- conversations on disk ---------------------------------------------------------------------------

    def save_session(self, path: str | Path, messages: list[dict] | None = None) -> Path:
        """Save the live sequence's KV (the last generation's prompt and reply) and `messages` to `path`."""
        from colibri.kv import session
        self._check_open()
        with self.engine.lock:
            live = self.kv.live
            return session.save(path, self._session_identity(), self.kv.layout,
                                live if live is not None and live.length else None, messages)

    def load_session(self, path: str | Path) -> list[dict]:
        """Make a saved sequence the live one (the next prompt that extends it prefills only its new tokens);
        returns the saved messages."""
        from colibri.kv import session
        self._check_open()
        with self.engine.lock:
            cache, messages = session.load(path, self._session_identity(), self.kv)
            self.kv.adopt(cache)
        return messages

    def _session_identity(self) -> dict:
        from colibri.kv import session
        return session.identity(self.checkpoint, self.args.model_type, self.kv.layout)

    def close(self) -> None:
        self.closed = True
        self.engine.close()
        self.store.close()
        self.kv.close()
        self.checkpoint.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan(config: EngineConfig | str | Path, memory_limit=None, **kwargs):
    """(Placement, Reserve, ModelArgs) that `load` with this config would use, without reading a weight.
    `plan(path, memory_limit, **options)` builds the config from keywords."""
    return _plan(config, memory_limit, None, **kwargs)[:3]


def plan_decode(config: EngineConfig | str | Path, memory_limit=None, context: int = 64, **kwargs):
    """`plan`'s (Placement, Reserve, ModelArgs), and the page ids the elastic budget pins beside the placement's
    own when a decode starts with `context` positions in the KV cache (its one-token passes leave the rest of the
    context's reserve to weights until the context grows: weights.streaming.pins)."""
    return _plan(config, memory_limit, context, **kwargs)


def _plan(config: EngineConfig | str | Path, memory_limit, context: int | None, **kwargs):
    """plan_decode's four values; the pins only where `context` is given (else an empty list)."""
    from colibri.weights.placement import WeightTable, plan as place
    from colibri.weights.streaming.pins import first_pins
    from colibri.weights.usage import USAGE_FILE, ExpertUsage

    if not isinstance(config, EngineConfig):
        config = EngineConfig.from_kwargs(config, memory_limit=memory_limit, **kwargs)
    path = config.model_path()
    ckpt, args, _ = open_model(path)
    try:
        if not isinstance(ckpt, ContainerCheckpoint):
            raise UnsupportedModelError(f"{path}: placement applies to Colibri containers; convert the model first")
        dt = resolve_dtype(config.dtype) or ckpt.default_dtype()
        conf, batch = fitted_settings(ckpt, args, dt, config)
        limit, res = conf.memory_limit, conf.reserve
        usage = None
        if args.num_experts:
            usage = ExpertUsage(ckpt.path / USAGE_FILE, args.num_layers, args.num_experts,
                                ExpertUsage.identity_of(ckpt)).loaded
        weights = WeightTable.of(ckpt, args)
        placement = place(weights, limit, config.prefetch_depth, res.total, batch, usage, dt)
        if context is None:
            return placement, res, args, []
        kv, ctx = conf.kv.layout, min(context, conf.ctx)
        held = -(-ctx // kv.block) * kv.block * kv.token_bytes + conf.kv.prefix_ram  # as engine.memory counts
        pins = first_pins(weights.pages, weights.tensors, placement, limit, dt, held,
                          budget.pass_bytes(args, dt, quantized(ckpt), 1, ctx, 1))
        return placement, res, args, pins
    finally:
        ckpt.close()


def load(path: str | Path | EngineConfig | None = None, **kwargs) -> Model:
    """Load a Colibri container, an HF model directory or a .gguf file: `load(EngineConfig(...))`, or
    `load(path, **options)` with the options of `EngineConfig` as keywords (colibri.core.config documents them).
    No path: the embedded default model's container, as `colibri run` runs it (converted into the cache on first
    use); a .gguf path is read as it is (dequantized).

    dtype: None (the checkpoint's default), "float32"/"bfloat16" or a torch dtype. memory_limit (bytes or a size
    like "600M", "2G"; containers only) bounds the weights, their staging, the KV pool and the activations of
    `batch_size` tokens; pages that do not fit are streamed from disk with O_DIRECT reads by `io_threads`
    threads, `prefetch_depth` pages ahead. batch_size: tokens per forward pass, all sequences together (a long
    prompt is prefilled in chunks of it); max_sequences: sequences decoded together.

    KV: kv_ram (bytes or a size) is the RAM for the KV pool (every sequence and the cached prefixes); a context
    whose KV does not fit keeps a window of recent blocks in RAM and the rest in the swap file: `swap` (a file
    made by `colibri swap create`) or a temporary one in `swap_dir` (default ~/.cache/colibri/swap).
    kv_quant="q8" stores K and V as int8 (lossy: docs/quality.md). kv_block: tokens per KV block (default: 64,
    fewer for a model whose 64-token block would exceed 4 MiB: kv.block_for).
    """
    try:  # a bad COLIBRI_KERNELS / COLIBRI_LOSSY_INT8 fails here, before any weight is read
        kernels.check_env()
    except ValueError as e:
        raise InputError(str(e)) from None
    config = path if isinstance(path, EngineConfig) else EngineConfig.from_kwargs(path, **kwargs)
    if config.model is None:  # the embedded default as the commands run it: its container, converted once
        from colibri.convert.pipeline import default_container
        from colibri.core import log
        config = config.replace(model=str(default_container(announce=lambda text: log.notice(f"colibri: {text}"))))
    return Model(config)
