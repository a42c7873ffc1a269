"""Memory honesty: under --memory-limit a process's RSS stays within the limit plus its measured runtime baseline,
the page cache does not fill with the weights (O_DIRECT), and the bytes the stats say were read are the bytes
the kernel accounts for the process."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from colibri.convert import pipeline as conv
from colibri.models import family

# A llama-shaped model of ~220 MB in bf16: large enough that a quarter of it is well above the minimum
# working set, small enough to build in seconds. Random weights: only placement and memory are under test.
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=16384, hidden_size=512,
              intermediate_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              torch_dtype="bfloat16")
CTX, BATCH, TOKENS = 512, 64, 24

CHILD = r"""
import json, sys, colibri
from colibri.core.metrics import peak_rss_bytes
def io_read():
    return int(open("/proc/self/io").read().split("read_bytes:")[1].split()[0])
path, limit, ctx, batch, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
r0 = io_read()
m = colibri.load(path, memory_limit=None if limit == "none" else int(limit), ctx_length=ctx, batch_size=batch)
ids = list(range(100, 140))
out = m.generate(ids, max_tokens=n, ignore_eos=True)
io = io_read() - r0
print(json.dumps({"tokens": out.token_ids, "baseline": m.baseline_rss_bytes,
                  "peak": peak_rss_bytes(),
                  "bytes_read": m.store.counters().get("bytes_read", 0), "io_read": io,
                  "total_weights": sum(p.nbytes for p in m.checkpoint.pages)}))
"""


# 16 sequences at once through the engine: their KV shares the pool the limit reserves for one context
CHILD_BATCH = r"""
import json, sys, colibri
from colibri.core.metrics import peak_rss_bytes
from colibri.engine.sampling import SamplingParams
path, limit, ctx, batch, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
m = colibri.load(path, memory_limit=limit, ctx_length=ctx, batch_size=batch, max_sequences=16)
reqs = [m.engine.add_request(list(range(100 + i, 120 + 3 * i)), SamplingParams(max_tokens=n, ignore_eos=True))
        for i in range(16)]
most = 0
while any(not r.finished for r in reqs):
    m.engine.step()
    most = max(most, len(m.engine.running))
print(json.dumps({"tokens": [r.token_ids for r in reqs], "errors": [repr(r.error) for r in reqs if r.error],
                  "baseline": m.baseline_rss_bytes, "peak": peak_rss_bytes(), "most_running": most,
                  "kv_pool_bytes": m.kv_pool_bytes, "steps": m.engine.steps,
                  "total_weights": sum(p.nbytes for p in m.checkpoint.pages)}))
"""


# A conversation that grows turn by turn: the elastic budget pins weight pages while the KV cache is small and
# unpins them (they stream again) as it grows, within the same limit
CHILD_ELASTIC = r"""
import json, sys, colibri
from colibri.core.metrics import peak_rss_bytes
path, limit, ctx, batch, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
m = colibri.load(path, memory_limit=None if limit == "none" else int(limit), ctx_length=ctx, batch_size=batch)
ids, turns = list(range(100, 116)), []
for turn in range(4):
    out = m.generate(ids, max_tokens=n, ignore_eos=True)
    st = m.stats()
    turns.append({"tokens": out.token_ids, "pinned": st.get("pinned_bytes", 0), "kv": m.kv.ram_bytes(),
                  "read": st.get("bytes_read", 0)})
    ids = ids + out.token_ids + list(range(300 + 110 * turn, 410 + 110 * turn))
floor = m.store.placement.pinned_bytes if m.store.placement is not None else 0
print(json.dumps({"turns": turns, "baseline": m.baseline_rss_bytes, "peak": peak_rss_bytes(), "floor": floor}))
"""


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(CONFIG))
    fam = family("llama")
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for name, shape in fam.Model(fam.args(CONFIG)).weight_shapes().items():
        t = torch.randn(shape, generator=g) * (0.02 if len(shape) == 2 else 0.1) + (1.0 if len(shape) == 1 else 0)
        tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, str(hf / "model.safetensors"))
    out = root / "c"
    conv.convert(hf, out, conv.ConvertOptions(quant="bf16", page_size_mb=2))
    return out


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        vec = ctypes.create_string_buffer((size + page - 1) // page)
        try:
            assert libc.mincore(addr, size, vec) == 0
        finally:
            libc.munmap(addr, size)
    return sum(1 for b in vec.raw if b & 1) * page


def run_child(path: Path, limit, child: str = CHILD, tokens: int = TOKENS) -> dict:
    for f in path.glob("data-*.bin"):  # a cold start for the weights
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    proc = subprocess.run([sys.executable, "-c", child, str(path), str(limit), str(CTX), str(BATCH), str(tokens)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_rss_page_cache_and_io_accounting_under_a_quarter_limit(container):
    ref = run_child(container, "none")
    limit = ref["total_weights"] // 4
    data = sorted(container.glob("data-*.bin"))
    got = run_child(container, limit)
    cached = sum(resident_bytes(f) for f in data)
    assert got["tokens"] == ref["tokens"]  # placement changes speed, never tokens
    # RSS: within the limit plus the runtime baseline measured in the same process (measured 3-4.5 MiB below)
    assert got["peak"] <= got["baseline"] + limit, (got["peak"] - got["baseline"], limit)
    # the page cache holds (almost) none of the weights: they were read with O_DIRECT
    assert cached <= 4 << 20, f"{cached} bytes of the data files are in the page cache"
    # what the stats say was read is what the kernel counted for the process
    assert got["bytes_read"] > 2 * ref["total_weights"]  # most weights were streamed on every token
    assert abs(got["io_read"] - got["bytes_read"]) <= 0.05 * got["bytes_read"], got


def test_sixteen_sequences_stay_within_the_limit(container):
    limit = run_child(container, "none")["total_weights"] // 4
    got = run_child(container, limit, CHILD_BATCH, tokens=8)
    assert not got["errors"] and all(len(t) == 8 for t in got["tokens"])
    # the pool the limit reserves holds one 512-token context (12.5 MiB, eight 64-token blocks); beside decode
    # passes, far smaller than the 64-token pass the reserve was sized for, it takes more (the elastic pins give
    # way): all 16 sequences (17-20 blocks) decode together, none fails
    assert got["most_running"] == 16, got["most_running"]
    assert got["peak"] <= got["baseline"] + limit, (got["peak"] - got["baseline"], limit)  # measured 2.7-4 MiB below


def test_elastic_budget_trades_pinned_weights_for_kv_as_a_conversation_grows(container):
    ref = run_child(container, "none", CHILD_ELASTIC, tokens=8)
    limit = sum(p.stat().st_size for p in container.glob("data-*.bin")) // 4
    got = run_child(container, limit, CHILD_ELASTIC, tokens=8)
    assert [t["tokens"] for t in got["turns"]] == [t["tokens"] for t in ref["turns"]]  # tokens never change
    pinned, kv = [t["pinned"] for t in got["turns"]], [t["kv"] for t in got["turns"]]
    # a short prompt pins more than the placement sized for the whole context; as the KV cache grows the pins fall
    assert pinned[0] > got["floor"] and pinned[-1] < pinned[0], (pinned, got["floor"])
    # (the KV ring grows by doubling up to the context: its RAM steps up, then stays)
    assert all(a >= b for a, b in zip(pinned, pinned[1:])) and all(a <= b for a, b in zip(kv, kv[1:])), (pinned, kv)
    assert kv[-1] > kv[0]
    assert got["peak"] <= got["baseline"] + limit, (got["peak"] - got["baseline"], limit)  # as above
