"""The `colibri` command: run, chat, serve, batch, stage, info, list, rm, convert, verify, plan, bench, swap,
kernels, doctor, tune. Each option is defined once, in OPTIONS."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from colibri.core import config, log
from colibri.core.errors import ColibriError, InputError, Terminated, oom_text, out_of_memory

# name -> (argparse kwargs, environment variable or None). Subcommands pick options by name.
OPTIONS: dict[str, tuple[dict[str, Any], str | None]] = {
    "model": (dict(help="HF model directory, .gguf file (default: the embedded SmolLM2-135M-Instruct)"),
              "COLIBRI_MODEL"),
    "dtype": (dict(choices=["float32", "bfloat16"], help="compute dtype (default: the checkpoint's; f32 for GGUF)"),
              None),
    "threads": (dict(type=int, help="CPU threads for compute (default: torch's choice)"), "COLIBRI_THREADS"),
    "memory_limit": (dict(help="memory budget, e.g. 600M, 2G (Colibri containers): it bounds the weights, their"
                               " staging buffers, the KV cache for the context and the activations; pages that do"
                               " not fit are streamed from disk. The runtime baseline (Python, torch, tokenizer)"
                               " is outside it"), "COLIBRI_MEMORY_LIMIT"),
    "ctx_length": (dict(type=int, help="maximum context in tokens; its KV cache is reserved in the memory limit"
                                       " (default: the model's; under --memory-limit one whose KV cache fits,"
                                       " at most 4096)"), None),
    "batch_size": (dict(type=int, default=config.DEFAULT_BATCH,
                        help="maximum tokens per forward pass, all sequences together: a long prompt is prefilled"
                             f" in chunks of it, shorter ones under a limit too tight for it (default"
                             f" {config.DEFAULT_BATCH})"), None),
    "max_sequences": (dict(type=int, default=config.DEFAULT_MAX_SEQUENCES,
                           help="sequences decoded together in one forward pass (default "
                                f"{config.DEFAULT_MAX_SEQUENCES})"), None),
    "kv_ram": (dict(help="RAM for the KV pool, e.g. 32M: every sequence's recent blocks and cached prefixes; a"
                         " context that needs more keeps older blocks in the swap file, and sequences that do not"
                         " fit wait there whole (default: the whole context, and under --memory-limit a quarter"
                         " of it at most)"), None),
    "kv_quant": (dict(choices=["q8"], help="store K and V as int8 with per-32-value scales (lossy, about half the"
                                          " memory and swap traffic; its cost is in docs/quality.md)"), None),
    "swap": (dict(help="KV swap file made by `colibri swap create` (default: a temporary one in"
                       " ~/.cache/colibri/swap, created when first needed and deleted on exit)"), None),
    "kv_dir": (dict(help="directory where the conversation (messages and KV cache) is saved after each turn and"
                         " resumed from (default with --session: ~/.cache/colibri/sessions)"), None),
    "session": (dict(help="name of a saved conversation to resume and keep saving (default with --kv-dir:"
                          " 'default')"), None),
    "path": (dict(required=True, help="swap file to create"), None),
    "size": (dict(required=True, help="swap file size, e.g. 4G"), None),
    "io_threads": (dict(type=int, default=config.DEFAULT_IO_THREADS,
                        help=f"threads reading streamed weights (default {config.DEFAULT_IO_THREADS})"), None),
    "prefetch_depth": (dict(type=int, help="streamed pages read ahead of use (default: one layer's streamed pages"
                                           " plus one)"), None),
    "draft_tokens": (dict(type=int, help="speculative decoding: tokens guessed from n-grams of the context and of"
                                         " text seen before, verified in the next forward pass (never changes the"
                                         " tokens); 0 = off, N = N whenever an n-gram matches (default: adaptive,"
                                         " sized by measured acceptance and pass cost)"), None),
    "ngram": (dict(type=int, help=f"longest n-gram a draft is matched on (default {config.DEFAULT_NGRAM})"), None),
    "ngram_cache_size": (dict(type=int, help="n-grams kept from earlier sequences for drafting, shared by all"
                                             f" (default {config.DEFAULT_NGRAM_CACHE}; 0 = own context only)"),
                         None),
    "lookahead": (dict(action=argparse.BooleanOptionalAction, help="MoE under --memory-limit: predict the next"
                                                                   " layer's experts with its router and read them"
                                                                   " early (default on; never changes tokens)"),
                  None),
    "lossy_int8_activations": (dict(action="store_true", default=None,
                                    help="LOSSY: q4/q8 weights and the GGUF K-quants multiply int8-quantized"
                                         " activations (every native tier), faster prefill and batches at a small"
                                         " quality cost (docs/performance.md; COLIBRI_LOSSY_INT8=1 does the same)"),
                               None),
    "sparse_ffn": (dict(nargs="?", const="default", metavar="SIDECAR",
                        help="LOSSY: skip the dense FFN neurons whose |act(gate)| is at or below their layer's"
                             " threshold, calibrated by `colibri calibrate` (SIDECAR: its file; default the"
                             " container's own sparse_ffn.safetensors). Its quality cost is in docs/quality.md"),
                   None),
    "text": (dict(action="append", metavar="FILE", help="calibration text, UTF-8 (repeatable; default: CPython's"
                                                        " own prose and source, as convert --calibration builtin)"),
             None),
    "target_sparsity": (dict(type=float, help="the layers' mean FFN sparsity to reach (0 to 0.95)"), None),
    "max_ppl_increase": (dict(type=float, help="the largest perplexity increase on the calibration text, in percent"
                                               " (default 2): the highest mean sparsity within it is chosen"), None),
    "allocation": (dict(choices=["uniform", "greedy"], default="uniform",
                        help="how the sparsity is spread over the layers: 'uniform' (every layer at the target, as"
                             " CATS; default) or 'greedy' (TEAL's allocation by each layer's FFN-output error;"
                             " measured worse, docs/quality.md)"), None),
    "prompt": (dict(help="prompt text (or give it as the command's last argument)"), None),
    "system": (dict(help="system message for the chat template"), None),
    "chat_template": (dict(metavar="FILE", help="a Jinja chat template file to use instead of the model's (the"
                                                " server reads its tool-call syntax from it)"), None),
    "max_tokens": (dict(type=int, default=config.DEFAULT_MAX_TOKENS,
                        help=f"maximum tokens to generate (default {config.DEFAULT_MAX_TOKENS})"), None),
    "temperature": (dict(type=float, default=0.0, help="sampling temperature; 0 = greedy (default)"), None),
    "top_p": (dict(type=float, default=1.0, help="nucleus sampling mass (default 1.0)"), None),
    "top_k": (dict(type=int, default=0, help="sample among the k most likely tokens; 0 = off"), None),
    "min_p": (dict(type=float, default=0.0, help="drop tokens below min_p x the top probability"), None),
    "repetition_penalty": (dict(type=float, default=1.0, help="penalty > 1 discourages repeats"), None),
    "presence_penalty": (dict(type=float, default=0.0, help="OpenAI's: subtracted once from the logit of every"
                                                         " token the reply holds, in [-2, 2]"), None),
    "frequency_penalty": (dict(type=float, default=0.0, help="OpenAI's: subtracted from a token's logit per"
                                                          " occurrence in the reply, in [-2, 2]"), None),
    "seed": (dict(type=int, help="random seed for sampling"), None),
    "stop": (dict(action="append", help="stop string (repeatable)"), None),
    "raw": (dict(action="store_true", help="send the prompt as is, without the chat template"), None),
    "json": (dict(action="store_true", help="print one JSON object (text, token ids, stats) instead of streaming"),
             None),
    "stats": (dict(action="store_true", help="print a stats line after each reply"), None),
    "verbose": (dict(action="store_true", help="show debug lines too (which kernels run)"), None),
    "quiet": (dict(action="store_true", help="hide notices (a kernel build, a tier passed over); warnings of lossy"
                                           " re-quantization still show"), None),
    "tokens": (dict(type=int, default=32, help="tokens to generate, EOS ignored (default 32)"), None),
    "probe_seconds": (dict(type=float, default=1.0, help="length of the disk bandwidth probe (default 1 s)"), None),
    "debug": (dict(action="store_true", help="show full tracebacks on errors"), None),
    "build": (dict(action="store_true", help="build (or load) the kernels COLIBRI_KERNELS picks and report the"
                                             " time"), None),
    "plot": (dict(help="also draw a picture into this file (.png, .svg, .pdf; needs matplotlib: pip install"
                       " 'colibri[plots]')"), None),
    "repeats": (dict(type=int, default=3, help="measurements of each candidate setting (default 3)"), None),
    "prefill_tokens": (dict(type=int, default=2 * config.DEFAULT_BATCH,
                            help="prompt tokens of each prefill measurement, which tunes --batch-size (default"
                                 f" {2 * config.DEFAULT_BATCH}; 0: decode settings only)"), None),
    "dir": (dict(help="directory whose filesystem the disk checks test (default: the model's, else Colibri's cache"
                      " directory, where KV swap files go)"), None),
    "input": (dict(required=True, help="HF model directory or .gguf file to convert (or a container, to export it"
                                       " with --output NAME.gguf)"), None),
    "output": (dict(required=True, help="container directory to create, or a NAME.gguf file: the --input container"
                                        " written back as a GGUF that llama.cpp loads (docs/format.md, \"Export to"
                                        " GGUF\")"), None),
    "quant": (dict(default="q4", help="q4 (Colibri's own policy; alias q4_0), q8, bf16, f16, f32, or a llama.cpp"
                                      " file type made from float weights as its quantizer would: q4_k_m, q5_k_m,"
                                      " q6_k, q8_0 (default q4)"), None),
    "imatrix": (dict(default="none", metavar="none|builtin|FILE",
                     help="q4_k_m / q5_k_m / q6_k: weight the block fits by each input channel's importance:"
                          " 'builtin' (measured on CPython's own prose and source, --calibration-tokens of it) or"
                          " FILE, an importance matrix llama-imatrix wrote (.gguf or .dat) for this model (default"
                          " none)"),
                None),
    "group_size": (dict(type=int, default=64, help="quantization group size: 32, 64 or 128 (default 64)"), None),
    "page_size": (dict(type=int, default=64, help="page size in MB: the unit of I/O and caching (default 64)"),
                  None),
    "force": (dict(action="store_true", help="overwrite an existing output directory"), None),
    "calibration": (dict(default="none", help="q4: text whose activations weight the q4 fit and measure each"
                                              " tensor's sensitivity: a UTF-8 file, 'builtin' (CPython's own prose"
                                              " and source) or 'none' (default: the fixed policy, v_proj,"
                                              " down_proj and the tables at q8, plain fit; measured better, see"
                                              " docs/quality.md)"), None),
    "calibration_tokens": (dict(type=int, default=1024, help="calibration tokens (default 1024)"), None),
    "mix": (dict(default="measured", choices=["measured", "fixed"],
                 help="calibrated q4: which tensors get q8 — 'measured' (the most sensitive per byte within"
                      " --bits-per-weight, default) or 'fixed' (v_proj, down_proj and the tables)"), None),
    "requantize": (dict(action="store_true",
                        help="GGUF input: re-quantize its Q4_K / Q5_K / Q6_K / Q3_K / Q2_K / IQ4 / Q5_0 / Q5_1"
                             " tensors by the q4 policy (lossy: rounded a second time; faster where q4 is) instead of"
                             " keeping them exactly (default)"),
                   None),
    "host": (dict(default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"), None),
    "port": (dict(type=int, default=8000, help="TCP port (default 8000)"), None),
    "api_key": (dict(help="require 'Authorization: Bearer KEY' on /v1 requests"), "COLIBRI_API_KEY"),
    "max_queue": (dict(type=int, default=64, help="requests that may wait for a sequence slot beyond the"
                                                  " --max-sequences running ones; more are answered 429 with"
                                                  " Retry-After (default 64)"), None),
    "shutdown_grace": (dict(type=float, default=10.0,
                            help="seconds requests in flight get to finish after SIGTERM / Ctrl-C; new ones get 503"
                                 " meanwhile, and those still running then end with a 503 'shutting_down' error"
                                 " (default 10)"), None),
    "ray": (dict(nargs="?", const="", metavar="ADDRESS",
                 help="run on a Ray cluster (pip install 'colibri[ray]'): ADDRESS as `ray start` printed it, or"
                      " none for RAY_ADDRESS, the cluster started on this machine, else a new local one"), None),
    "replicas": (dict(type=int, help="--ray: engines to start, spread over the nodes (default: one per node),"
                                     " each on its node's copy of --model"), None),
    "model_name": (dict(help="the model id clients send and /v1/models lists (default: the checkpoint's file or"
                             " directory name)"), None),
    "bits_per_weight": (dict(type=float, help="q4 size budget in bits per weight, spent on q8 for the most"
                                              " sensitive tensors (default: the size llama.cpp's Q4_K_M would"
                                              " take)"), None),
}
# Bounds of numeric options, checked once after parsing (a bad value is one `error:` line naming the option):
# option -> (smallest, largest) accepted; None: unbounded on that side.
BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "threads": (1, None), "io_threads": (1, 64), "prefetch_depth": (0, None), "ctx_length": (1, None),
    "batch_size": (1, None), "max_sequences": (1, 4096), "max_tokens": (0, None), "temperature": (0, None),
    "top_p": (0, 1), "top_k": (0, None), "min_p": (0, 1), "repetition_penalty": (0, None),
    "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2),
    "seed": (-2**63, 2**64 - 1), "tokens": (1, None), "repeats": (1, 20), "probe_seconds": (0, 3600), "group_size": (1, None),
    "page_size": (1, 4096), "calibration_tokens": (1, None), "bits_per_weight": (1, 16), "prefill_tokens": (0, None),
    "port": (0, 65535), "replicas": (1, 1024), "max_queue": (0, None), "shutdown_grace": (0, 3600),
    "target_sparsity": (0, 0.95), "max_ppl_increase": (0, 1000),
    "draft_tokens": (0, config.MAX_DRAFT_TOKENS), "ngram": (1, 16), "ngram_cache_size": (0, None),
}


def check_bounds(args) -> None:
    """InputError for the first numeric option outside BOUNDS (or a float that is not finite)."""
    for name, (lo, hi) in BOUNDS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{flag} must be a finite number (got {value})")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = (f"between {lo} and {hi}" if lo is not None and hi is not None else
                    f"at least {lo}" if lo is not None else f"at most {hi}")
            raise InputError(f"{flag} must be {span} (got {value})")


COMMON = ["model", "dtype", "threads", "memory_limit", "io_threads", "prefetch_depth", "ctx_length", "batch_size",
          "lossy_int8_activations", "debug"]
ENGINE = ["max_sequences", "draft_tokens", "ngram", "ngram_cache_size", "lookahead", "sparse_ffn"]
KV = ["kv_ram", "kv_quant", "swap"]
JSON_REPORT = dict(help="print one JSON object with every number instead of the summary")
SAMPLING = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "stop"]


# The one-letter forms of the options every llama.cpp / ollama / mlx-lm user types.
SHORT = {"model": "-m", "prompt": "-p", "max_tokens": "-n", "ctx_length": "-c", "threads": "-t", "quiet": "-q",
         "verbose": "-v"}
# other spellings of an option (bench's --tokens is what run and the server call max_tokens)
ALIASES = {"tokens": ("-n", "--max-tokens")}


# --help's sections: the shared option lists, each under its title (a command's own options come first)
GROUPS = (("model, threads and memory", COMMON), ("engine: sequences, speculation, lookahead", ENGINE),
          ("KV cache", KV), ("sampling", SAMPLING))


def add(parser: argparse.ArgumentParser, *names: str, **changes: dict[str, Any]) -> None:
    """Add the named options; `changes` (option name -> argparse kwargs) adjusts one for this subcommand. Options
    of a shared list go into its --help section when the command takes the whole list."""
    sections = {}
    for title, group in GROUPS:
        if set(group) <= set(names):
            section = parser.add_argument_group(title)
            sections.update((n, section) for n in group)
    for name in names:
        kwargs, env = OPTIONS[name]
        kwargs = {**kwargs, **changes.get(name, {})}
        if env:
            kwargs["help"] += f" [env {env}]"
        if env and os.environ.get(env):
            kwargs["default"] = os.environ[env]  # a string default goes through `type` like an argument
            kwargs["required"] = False
        flags = [SHORT[name]] if name in SHORT else []
        sections.get(name, parser).add_argument(*flags, "--" + name.replace("_", "-"), *ALIASES.get(name, ()),
                                                dest=name, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from colibri.core import __version__

    p = argparse.ArgumentParser(prog="colibri", description="LLM inference that streams weights from an SSD.")
    p.add_argument("--version", action="version", version=f"colibri {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")  # none: the help (main)
    run = sub.add_parser("run", help="generate a reply to one prompt")
    run.add_argument("text", nargs="?", metavar="PROMPT", help="prompt text (the same as --prompt)")
    add(run, *COMMON, *ENGINE, *KV, "prompt", "system", "chat_template", *SAMPLING, "raw", "json", "verbose",
        verbose=dict(help="show debug lines too (which kernels run), and a per-layer timeline of the first forward"
                          " passes (streamed containers: pages, bytes read on demand, wait and compute per scope)"))
    chat = sub.add_parser("chat", help="multi-turn chat on the terminal (reads lines from stdin)")
    add(chat, *COMMON, *ENGINE, *KV, "system", "chat_template", *SAMPLING, "stats", "kv_dir", "session")
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    add(srv, *COMMON, *ENGINE, *KV, "chat_template", "host", "port", "api_key", "max_queue", "shutdown_grace",
        "model_name", "ray", "replicas")
    bat = sub.add_parser("batch", help="run a JSONL file of prompts through the engine together, resumably")
    add(bat, *COMMON, *ENGINE, *KV, "input", "output", *SAMPLING, "ray", "replicas",
        input=dict(help='JSONL input: one {"id": ..., "prompt": str} or {"id": ..., "messages": [...]} per line,'
                        " optionally with sampling fields (max_tokens, temperature, ...), or OpenAI Batch input"
                        " lines ({custom_id, method, url, body})"),
        output=dict(help="JSONL results, one line per id (OpenAI Batch output lines for OpenAI input), appended as"
                         " each finishes; ids already there are skipped (resume)"),
        max_tokens=dict(help="maximum tokens per line unless the line says (default"
                             f" {config.DEFAULT_MAX_TOKENS})"))
    stg = sub.add_parser("stage", help="copy a container onto this machine's disk, or every node's of a Ray cluster"
                                       " (--ray), and verify it there")
    add(stg, "model", "output", "ray", "debug",
        model=dict(help="container directory to copy (default: the embedded model's container)"),
        output=dict(required=True, help="directory to create on each node (the same path everywhere: give it as"
                                        " --model to batch --ray and serve --ray); one already holding this"
                                        " container is verified, not copied"))
    info = sub.add_parser("info", help="describe a model without loading its weights")
    add(info, "model", "debug")
    lst = sub.add_parser("list", help="the models Colibri manages by name: name, size, kinds, created, verified, source")
    add(lst, "json", "debug", json=dict(help="print one JSON object per model instead of the table"))
    rm = sub.add_parser("rm", help="delete a model Colibri manages, by its name in `colibri list`")
    rm.add_argument("name", metavar="NAME", help="the model's name in `colibri list`")
    add(rm, "debug")
    conv = sub.add_parser("convert", help="convert an HF directory or GGUF file into a Colibri container, or a"
                                          " container into a GGUF (--output NAME.gguf)")
    add(conv, "input", "output", "quant", "group_size", "page_size", "calibration", "calibration_tokens",
        "bits_per_weight", "mix", "requantize", "imatrix", "force", "debug")
    cal = sub.add_parser("calibrate", help="calibrate a container's LOSSY sparse FFN (--sparse-ffn): per-layer"
                                           " thresholds and the neurons' co-activation order, in a sidecar")
    add(cal, "model", "text", "target_sparsity", "max_ppl_increase", "allocation", "calibration_tokens", "output",
        "debug",
        model=dict(help="container directory (default: the embedded model's container)"),
        calibration_tokens=dict(help="tokens of the text calibrated on, in one pass (default 512)", default=512),
        output=dict(required=False, help="the sidecar to write (default: sparse_ffn.safetensors in the"
                                         " container)"))
    ver = sub.add_parser("verify", help="recompute every checksum of a container")
    ver.add_argument("dir", nargs="?", metavar="DIR", help="container directory (as --model; DIR wins over it)")
    add(ver, "model", "debug", model=dict(help="container directory (default: the embedded model's container)"))
    pl = sub.add_parser("plan", help="placement, bytes read per token and predicted decode speed, without loading")
    add(pl, *COMMON, "probe_seconds", "json", "plot", json=JSON_REPORT,
        plot=dict(help="also draw the placement (page bytes per layer: pinned, streamed, read by rows) into this file"
                       " (.png, .svg, .pdf; needs matplotlib: pip install 'colibri[plots]')"))
    be = sub.add_parser("bench", help="decode benchmark from a cold start, measured against the plan's prediction")
    add(be, *COMMON, "tokens", "prompt", "probe_seconds", "sparse_ffn", "json", "plot", json=JSON_REPORT,
        plot=dict(help="also draw the per-layer timeline of the first passes (each scope's wait for reads and its"
                       " compute, the bytes read on demand) into this file (.png, .svg, .pdf; needs matplotlib: pip"
                       " install 'colibri[plots]')"),
        prompt=dict(required=False, help="prompt text, sent without the chat template (default: a fixed sentence)"))
    sw = sub.add_parser("swap", help="manage KV swap files")
    swsub = sw.add_subparsers(dest="swap_command", required=True)
    swc = swsub.add_parser("create", help="preallocate a KV swap file (fallocate), keeping 1 GiB of the disk free")
    add(swc, "path", "size", "debug")
    kern = sub.add_parser("kernels", help="the native kernel tiers: which this CPU runs, which are built, which one"
                                          " is used and why (COLIBRI_KERNELS)")
    add(kern, "build", "json", "debug", json=dict(help="print one JSON object instead of the listing"))
    tun = sub.add_parser("tune", help="measure settings (io threads, prefetch depth, threads, OpenMP wait policy,"
                                      " batch size) under a memory limit and keep a profile beside the container"
                                      " only when one wins by 3 %%")
    add(tun, "model", "memory_limit", "tokens", "repeats", "prefill_tokens", "json", "debug",
        model=dict(required=True, help="Colibri container to tune (the profile is written into it)"),
        memory_limit=dict(required=True, help="the memory limit the profile is for, e.g. 400M (run, chat, serve"
                                              " and batch use the profile at exactly this limit)"),
        tokens=dict(help="tokens each measurement decodes, EOS ignored (default 32)"),
        json=dict(help="print the report as one JSON object"))
    doc = sub.add_parser("doctor", help="check this machine for streaming a model: O_DIRECT, disk speed, huge pages,"
                                        " memory, CPU, kernels, swap room, the container; each with what to do")
    add(doc, "model", "dir", "probe_seconds", "json", "debug",
        model=dict(help="model whose filesystem, read speed, size and container to check (default: none; those"
                        " checks are skipped)"),
        json=dict(help="print one JSON object instead of the listing"))
    for command in sub.choices.values():  # -q / -v on every command (run's -v is added above, with its timeline)
        add(command, "quiet", *(() if command is run else ("verbose",)))
    return p


def model_path(args, engine: bool = True) -> str:
    """--model, else the embedded default: for the commands that run it, a GGUF file's container in the managed
    cache (converted on first use, exact kinds kept; later starts reuse it), the GGUF itself to describe
    (`engine=False`)."""
    if args.model:  # a path, a name from `colibri list` or a Hugging Face hub id
        from colibri.convert.managed import resolve
        from colibri.formats.checkpoint import is_gguf_file
        path = resolve(args.model)
        if engine and is_gguf_file(Path(path)):
            from colibri.convert.managed import models_root
            from colibri.convert.pipeline import DEFAULT_KIND, cached_container
            return str(cached_container(Path(path).absolute(), models_root(), DEFAULT_KIND, label=Path(path).name,
                                        announce=lambda text: log.notice(f"colibri: {text}")))
        return path
    if engine:
        from colibri.convert.pipeline import default_container
        return str(default_container(announce=lambda text: log.notice(f"colibri: {text}")))
    from colibri.core.defaults import default_model_path
    return str(default_model_path())


def engine_config(args, resolve: bool = True) -> config.EngineConfig:
    """The EngineConfig of a subcommand's options, the model path resolved (`resolve=False`: as given, None for
    the embedded default, which each node of a cluster resolves to its own copy)."""
    cfg = config.EngineConfig.from_args(args)
    return tuned(args, cfg.replace(model=model_path(args))) if resolve else cfg


def tuned(args, cfg: config.EngineConfig) -> config.EngineConfig:
    """`cfg` with the settings of a `colibri tune` profile beside its container for this memory limit, where no
    option sets them (said on stderr). Not for a cluster's nodes: a profile is measured on one machine."""
    from colibri.perf.tune import PROFILE, profile_for
    profile = profile_for(cfg.model, cfg.memory_limit) if os.path.isdir(cfg.model) else None
    if profile is None:
        return cfg
    settings = dict(profile["settings"])
    policy = settings.pop("omp_wait_policy", None)  # set by quiet_openmp before torch loaded, if at all
    given = {"threads": getattr(args, "threads", None) is not None,
             "prefetch_depth": getattr(args, "prefetch_depth", None) is not None,
             # an explicit --io-threads or --batch-size equal to the default cannot be told from none
             "io_threads": getattr(args, "io_threads", config.DEFAULT_IO_THREADS) != config.DEFAULT_IO_THREADS,
             "batch_size": getattr(args, "batch_size", config.DEFAULT_BATCH) != config.DEFAULT_BATCH}
    taken = {k: v for k, v in settings.items() if not given[k]}
    said = [f"--{k.replace('_', '-')} {v}" for k, v in taken.items()]
    if policy not in (None, "default") and os.environ.get("OMP_WAIT_POLICY", "").upper() == policy:
        said.append(f"OMP_WAIT_POLICY={policy}")
    if said:
        log.notice(f"colibri: tuned profile {os.path.join(cfg.model, PROFILE)}: " + ", ".join(said)
                   + f" ({profile['gain_pct']:+.1f} % decode, {profile.get('prefill_gain_pct', 0.0):+.1f} % prefill"
                     " tok/s measured by colibri tune; an option given overrides it)")
    return cfg.replace(**taken)


def load_model(args):
    from colibri.runtime.model import load
    return load(engine_config(args))


def sampling(args) -> dict[str, Any]:
    return {name: getattr(args, name) for name in SAMPLING}


VERBOSE_PASSES = 3  # forward passes (the prompt's, then decode steps) shown by --verbose


def cmd_run(args) -> int:
    with load_model(args) as m:  # closing saves what the store learned (usage.json) and removes temporary files
        return run_prompt(args, m)


def run_prompt(args, m) -> int:
    from colibri.core.metrics import GenerationMetrics
    if args.raw:
        ids = m.prompt_ids(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = m.chat_ids(messages + [{"role": "user", "content": args.prompt}])
    from colibri.engine import generate as gen
    from colibri.core.metrics import format_timeline
    params = m.sampling_params(**sampling(args))
    timeline = args.verbose and m.store.timeline is not None
    if timeline:
        m.store.timeline_passes = VERBOSE_PASSES
    if args.json:
        r = gen.generate(m.engine, ids, params)
        stats = {**r.stats, "model": m.stats()}
        if timeline:
            stats["timeline"] = m.store.timeline
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "prompt_tokens": r.prompt_tokens,
                          "finish_reason": r.finish_reason, "stats": stats}, ensure_ascii=False))
        return 0
    metrics = GenerationMetrics()
    for chunk in gen.stream(m.engine, ids, params):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        metrics = chunk.metrics
    sys.stdout.write("\n")
    if timeline:
        print(format_timeline(m.store.timeline), file=sys.stderr)
    print(metrics.summary(), file=sys.stderr)
    return 0


def session_path(args):
    """The conversation file of --kv-dir / --session, or None when neither is given."""
    if not args.kv_dir and not args.session:
        return None

    from colibri.core.defaults import cache_dir
    name = args.session or "default"
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise InputError(f"--session {name!r}: use letters, digits, '-', '_' or '.'")
    return Path(args.kv_dir or cache_dir() / "sessions") / f"{name}.kv"


def cmd_chat(args) -> int:
    from colibri.kv.session import SessionLock
    saved = session_path(args)
    if saved is None:
        return chat_loop(args, None)
    with SessionLock(saved):  # one chat per conversation: a second is refused before it loads anything
        return chat_loop(args, saved)


def chat_loop(args, saved) -> int:
    with load_model(args) as m:
        return chat_turns(args, saved, m)


def chat_turns(args, saved, m) -> int:
    if m.tokenizer is None or m.tokenizer.chat_template is None:
        raise InputError(f"{m.path} has no chat template; use `colibri run --raw` instead")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    if saved is not None and saved.exists():
        history = [msg for msg in m.load_session(saved) if msg.get("role") != "system"]
        print(f"(resumed {saved}: {len(history)} messages, {m.kv.live.length} tokens of KV)", file=sys.stderr)
    interactive = sys.stdin.isatty()
    if interactive:
        print("colibri chat: type a message; /reset clears the conversation, /exit quits.", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            history = []
            if saved is not None:
                saved.unlink(missing_ok=True)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        reply, metrics = [], None
        for chunk in m.stream_chat(system + history, **sampling(args)):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            reply.append(chunk.text)
            metrics = chunk.metrics
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
        if saved is not None:
            m.save_session(saved, system + history)
        if args.stats and metrics:
            print(metrics.summary(), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from colibri.server import serve
    name = args.model_name
    if name is None and not args.model:  # the embedded default: its own name, not its cached container's
        from colibri.core.defaults import default_model_path
        name = default_model_path().stem
    elif name is None and not os.path.exists(args.model):  # a listed name or a hub id: clients send it as given
        name = args.model
    if args.ray is not None:
        from colibri import router
        from colibri.server import model_id
        name = name or model_id(config.EngineConfig.from_args(args))
        router.serve(args, engine_config(args, resolve=False), name)
        return 0
    serve(engine_config(args), host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
          name=name, shutdown_grace_s=args.shutdown_grace)
    return 0


def cmd_batch(args) -> int:
    from colibri import batch
    if args.ray is None:
        return batch.run(args, sampling(args), batch.local(args, load_model))
    from colibri import cluster
    return batch.run(args, sampling(args), cluster.batch_job(args, engine_config(args, resolve=False)))


def cmd_swap(args) -> int:
    from colibri.kv import swap
    from colibri.core.defaults import parse_size
    path = swap.create(args.path, parse_size(args.size))
    print(f"created {path} ({path.stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)
    return 0


def cmd_kernels(args) -> int:
    from colibri import kernels
    built = None
    if args.build:  # before the listing, so that it shows the result
        t0 = time.perf_counter()
        built = dict(tier=kernels.tier(), seconds=round(time.perf_counter() - t0, 1))
    report = {**kernels.describe(), **({"built_now": built} if built else {})}
    if args.json:
        print(json.dumps(report))
        return 0
    have = report["cpu_flags"]
    print("CPU flags: " + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in have.items()))
    print(f"C++ compiler: {report['compiler'] or 'none found ($CXX, else c++)'}")
    print(f"{'tier':<9} {'runnable':<32} {'built':<6} LOSSY int8")
    for r in report["tiers"]:
        run = "yes" if r["runnable"] else "no: needs " + ", ".join(r["missing"])
        done = "-" if r["built"] is None else "yes" if r["built"] else "no"
        with_ = ", ".join(r["int8"]["faster_with"])
        int8 = f"yes{f' (with {with_})' if with_ else ''}" if r["int8"]["usable"] else f"no ({r['int8']['why']})"
        print(f"{r['name']:<9} {run:<32} {done:<6} {int8}")
    for r in report["tiers"]:
        if r["error"]:
            print(f"  {r['error']}")
        elif r["built"]:
            print(f"  {r['name']}: {r['library']}")
    for setting, pick in (("auto", report["auto"]), (report["setting"], report["pick"])):
        print(f"{kernels.MODE_ENV}={setting} picks {pick['tier']}: {pick['why']}")
        if setting == report["setting"]:
            break
    if built:
        print(f"in use: {built['tier']} (built or loaded in {built['seconds']} s)")
    return 0


def cmd_tune(args) -> int:
    from colibri.perf import tune
    from colibri.perf.runner import is_container
    from pathlib import Path
    args.model = model_path(args)  # a listed name or a hub id, as a path
    if not is_container(Path(args.model)):
        raise InputError(f"--model {args.model}: tune measures a Colibri container; convert the model first")
    report = tune.tune(args.model, args.memory_limit, tokens=args.tokens, repeats=args.repeats,
                       prefill_tokens=args.prefill_tokens)
    if args.json:
        print(json.dumps(report))
    return 0


def cmd_doctor(args) -> int:
    from colibri.perf import doctor
    model = model_path(args, engine=False) if args.model else None  # a listed name or a hub id, as a path
    checks = doctor.diagnose(model, args.dir, probe_seconds=args.probe_seconds)
    print(json.dumps(doctor.as_json(checks)) if args.json else doctor.format_checks(checks))
    return 1 if any(c.status == doctor.FAIL for c in checks) else 0


def cmd_list(args) -> int:
    from colibri.convert.managed import listed, models_root
    models = listed()
    if args.json:
        for m in models:
            print(json.dumps(m.as_dict()))
        return 0
    if not models:
        print(f"no models in {models_root()} (a hub id or the default model given to --model lands there once"
              " converted)", file=sys.stderr)
        return 0
    def when(t: float | None) -> str:
        return "never" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))

    rows = [("NAME", "SIZE", "KINDS", "CREATED", "VERIFIED", "SOURCE")]
    rows += [(m.name, f"{m.size / 2**30:.2f} GiB", ",".join(m.kinds), when(m.created), when(m.verified), m.source)
             for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5])
    return 0


def cmd_rm(args) -> int:
    from colibri.convert.managed import remove
    print(f"removed {remove(args.name)}", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from colibri.runtime.model import describe
    for key, value in describe(model_path(args, engine=False)).items():
        print(f"{key:>16}: {value}")
    return 0


def cmd_convert(args) -> int:
    from tqdm import tqdm

    from colibri.convert.pipeline import ConvertOptions, convert, progress_lines
    export = args.output.lower().endswith(".gguf")  # a container written back as a GGUF
    if not export:
        opts = ConvertOptions(quant=args.quant, group_size=args.group_size, page_size_mb=args.page_size,
                              calibration=args.calibration, bits_per_weight=args.bits_per_weight,
                              calibration_tokens=args.calibration_tokens, mix=args.mix, requantize=args.requantize,
                              imatrix=args.imatrix)
    bars: dict[str, tqdm] = {}
    if not sys.stderr.isatty():  # a log file or a pipe: whole lines
        progress = progress_lines(args.input)
    else:
        def progress(phase: str, done: int, total: int) -> None:
            if phase not in bars:
                for b in bars.values():
                    b.close()
                bars[phase] = tqdm(total=total or None, desc=phase, file=sys.stderr,
                                   **({"unit": "layer"} if phase == "calibrating" else
                                      {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if total else {}))
            bar = bars[phase]
            bar.total = total or None
            bar.update(done - bar.n)

    try:
        if export:
            from colibri.convert.export import export_gguf
            done = export_gguf(args.input, args.output, force=args.force, progress=progress)
            print(f"wrote {done.output} ({done.bytes_written / 2**20:.1f} MiB of tensors) in {done.seconds:.1f} s",
                  file=sys.stderr)
            return 0
        report = convert(args.input, args.output, opts, force=args.force, progress=progress)
    finally:
        for b in bars.values():
            b.close()
    resumed = f", resumed {report.resumed_pages} pages" if report.resumed_pages else ""
    print(f"wrote {report.output} ({report.total_bytes / 2**20:.1f} MiB) in {report.seconds:.1f} s{resumed}",
          file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from tqdm import tqdm

    from colibri.runtime import sparse_calibrate
    bar = tqdm(desc="calibrating", unit="step", file=sys.stderr, disable=None)  # None: no bar off a terminal

    def progress(phase: str, done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        out, side = sparse_calibrate.calibrate(model_path(args), args.text, args.target_sparsity,
                                               args.max_ppl_increase, args.calibration_tokens, args.output, progress,
                                               args.allocation)
    finally:
        bar.close()
    i = side.info
    print(f"wrote {out}: mean FFN sparsity {i['target_sparsity']:.2f}, perplexity on the calibration text"
          f" {i['perplexity_dense']:.3f} dense -> {i['perplexity_sparse']:.3f} sparse; chunks of {side.chunk}"
          f" neurons skipped per token: {i['chunk_sparsity_coactivation_order']:.1%} in co-activation order"
          f" ({i['chunk_sparsity_stored_order']:.1%} in the stored order)", file=sys.stderr)
    return 0


def cmd_stage(args) -> int:
    from colibri import cluster
    cluster.stage(model_path(args), args.output, args.ray,
                  lambda text: print(f"colibri stage: {text}", file=sys.stderr))
    return 0


def cmd_verify(args) -> int:
    from colibri.formats.container import ContainerCheckpoint
    args.model = args.dir or args.model  # DIR, else --model (or COLIBRI_MODEL), else the default's container
    path = model_path(args)
    ckpt = ContainerCheckpoint(path)
    bad = list(ckpt.verify())
    for where, what in bad:
        print(f"checksum mismatch: {where}: {what}", file=sys.stderr)
    if bad:
        print(f"error: {path}: {len(bad)} damaged page(s); reconvert the model", file=sys.stderr)
        return 1
    print(f"ok: {len(ckpt.pages)} pages, {len(ckpt.tensors)} tensors verified")
    from colibri.convert.managed import mark_verified
    mark_verified(path)  # `colibri list` shows when
    return 0


def streaming_options(args) -> dict[str, Any]:
    return dict(memory_limit=args.memory_limit, dtype=args.dtype, io_threads=args.io_threads,
                prefetch_depth=args.prefetch_depth, ctx_length=args.ctx_length, batch_size=args.batch_size,
                probe_seconds=args.probe_seconds)


def cmd_plan(args) -> int:
    import torch

    from colibri.perf import runner
    if args.threads:
        torch.set_num_threads(args.threads)
    report = runner.predict(model_path(args), **streaming_options(args))
    print(json.dumps(report.as_dict()) if args.json else runner.format_plan(report))
    if args.plot:
        from colibri.perf import plots
        if report.layout is None:
            raise InputError("--plot draws a container's placement; this model is not one (colibri convert it)")
        print(f"wrote {plots.placement_plot(report.layout, args.plot)}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from colibri.perf import runner
    if args.plot:
        from colibri.perf import plots
        plots.pyplot()  # no matplotlib: say so before the run, not after it
    report = runner.run_bench(model_path(args), tokens=args.tokens, prompt=args.prompt, threads=args.threads,
                              sparse_ffn=args.sparse_ffn, timeline_passes=VERBOSE_PASSES if args.plot else 0,
                              **streaming_options(args))
    print(json.dumps(report.as_dict()) if args.json else runner.format_bench(report))
    if args.plot:
        title = f"{os.path.basename(report.model)}: first {VERBOSE_PASSES} passes under --memory-limit" \
                f" {(report.memory_limit_bytes or 0) / 2**20:.0f} MiB"
        print(f"wrote {plots.timeline_plot(report.timeline, args.plot, title)}", file=sys.stderr)
    return 0


def streams_dense(args) -> bool:
    """Whether this command will stream the weights of a dense model: a container without expert pages whose
    pages exceed --memory-limit (read from its manifest, without torch). Unreadable input answers False;
    loading reports it properly."""
    limit = getattr(args, "memory_limit", None)
    if not limit or not getattr(args, "model", None):
        return False
    try:
        from colibri.core.defaults import parse_size
        with open(os.path.join(args.model, "manifest.json")) as f:
            pages = json.load(f)["pages"]
        if any(p.get("kind") == "expert" for p in pages):
            return False
        return sum(int(p["nbytes"]) for p in pages) > parse_size(limit)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ColibriError):
        return False


def quiet_openmp(args) -> None:
    """Runs that stream a dense model's weights get OMP_WAIT_POLICY=PASSIVE: torch's OpenMP workers then sleep
    between kernels instead of spinning (libgomp's default), since a spinning worker holds a core that the
    weight reads, which interleave with compute, need. Not for MoE: its compute waits a whole expert read at a
    time, and workers asleep that long wake slowly, which costs more than spinning takes from the reads; nor
    all in RAM, where nothing is read. The figures are in docs/performance.md, section "Disk" ("Spinning
    OpenMP workers slow the reads"). OpenMP reads it once, when torch loads: a user's own OMP_WAIT_POLICY
    wins, and in-process callers keep theirs."""
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ:
        return
    policy = tuned_openmp(args)
    if policy is not None:  # measured by colibri tune for this container and limit
        if policy != "default":
            os.environ["OMP_WAIT_POLICY"] = policy
    elif streams_dense(args):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def tuned_openmp(args) -> str | None:
    """The OpenMP wait policy of a `colibri tune` profile beside --model for --memory-limit, or None."""
    model, limit = getattr(args, "model", None), getattr(args, "memory_limit", None)
    if args.command not in ("run", "chat", "serve", "batch") or not model or not os.path.isdir(model):
        return None
    from colibri.perf.tune import profile_for
    profile = profile_for(model, limit)
    return profile["settings"].get("omp_wait_policy") if profile else None


def check_kernel_env() -> None:
    """A bad COLIBRI_KERNELS (or COLIBRI_LOSSY_INT8), or a forced kernel tier this CPU lacks, is one `error:`
    line before any work, not an error in the first forward pass. Imported here, after quiet_openmp: colibri.kernels
    imports torch, and OpenMP reads OMP_WAIT_POLICY when torch loads."""
    from colibri import kernels
    try:
        kernels.check_env()
    except ValueError as e:
        raise InputError(str(e)) from None


def _terminate(signum, frame) -> None:
    raise Terminated()


def prompt_of(args) -> None:
    """`colibri run`'s prompt: the positional text or --prompt, exactly one of them (InputError otherwise)."""
    if args.text is not None and args.prompt is not None:
        raise InputError("give the prompt once: as the last argument or with --prompt, not both")
    if args.text is None and args.prompt is None:
        raise InputError('no prompt: colibri run "your prompt" (or --prompt TEXT)')
    args.prompt = args.prompt if args.text is None else args.text


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `colibri`: what it can do, not an error
        parser.print_help()
        return 0
    log.set_level(args.quiet, args.verbose)  # every call: an in-process caller's last -q does not stick
    quiet_openmp(args)
    handler = {"run": cmd_run, "chat": cmd_chat, "serve": cmd_serve, "batch": cmd_batch, "stage": cmd_stage,
               "info": cmd_info, "list": cmd_list, "rm": cmd_rm, "convert": cmd_convert, "calibrate": cmd_calibrate,
               "verify": cmd_verify, "plan": cmd_plan, "bench": cmd_bench, "swap": cmd_swap,
               "kernels": cmd_kernels, "doctor": cmd_doctor, "tune": cmd_tune}[args.command]
    # SIGTERM unwinds like Ctrl-C: `finally` blocks and atexit run (temporary swap files go), with a message
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        check_bounds(args)
        if args.quiet and args.verbose:
            raise InputError("give -q (notices hidden) or -v (debug lines too), not both")
        if args.command == "run":
            prompt_of(args)
        check_kernel_env()
        return handler(args)
    except Terminated:
        print("\nterminated (SIGTERM); temporary files removed", file=sys.stderr)
        return 128 + signal.SIGTERM
    except ColibriError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - a user sees one line; --debug shows where
        if args.debug:
            traceback.print_exc()
        if out_of_memory(e):
            print(f"error: out of memory ({oom_text(e)}); give --memory-limit (a converted container streams its"
                  " weights from disk), or use a smaller model, context or batch", file=sys.stderr)
            return 2
        print(f"error: internal error ({type(e).__name__}: {e}); rerun with --debug and report it", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
