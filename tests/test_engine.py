"""The engine: many sequences in one forward pass give each the tokens it gets alone, share the weight reads,
and stay within the KV pool by preempting to the swap file; a request that cannot fit is refused alone."""

from __future__ import annotations

import threading

import pytest

import colibri
import colibri.runtime.model
import tiny_models
from colibri.convert import pipeline as conv
from colibri.core.config import EngineConfig
from colibri.core.errors import InputError
from colibri.engine.sampling import SamplingParams

N = 16
BLOCK = 4


def prompts(n: int = N, vocab: int = 384) -> list[list[int]]:
    """n prompts of different lengths (3..48 tokens)."""
    return [tiny_models.token_ids(3 + (7 * i) % 46, vocab, seed=100 + i) for i in range(n)]


def max_tokens(n: int = N) -> list[int]:
    return [4 + (5 * i) % 13 for i in range(n)]  # 4..16: sequences leave at different steps


def solo(m, ps, mts, **sampling) -> list[list[int]]:
    return [m.generate(p, max_tokens=t, ignore_eos=True, **sampling).token_ids for p, t in zip(ps, mts)]


def batched(m, ps, mts, join=None, seeds=None, **sampling) -> list[list[int]]:
    """Run every prompt through one engine, prompt i joining at step join[i] (default: i, so 1..N run at once
    as they arrive and leave), and return each one's generated ids."""
    eng, reqs, step = m.engine, {}, 0
    join = list(range(len(ps))) if join is None else join
    while len(reqs) < len(ps) or any(not r.finished for r in reqs.values()):
        for i, p in enumerate(ps):
            if i not in reqs and join[i] <= step:
                seed = None if seeds is None else seeds[i]
                reqs[i] = eng.add_request(p, SamplingParams(max_tokens=mts[i], ignore_eos=True, seed=seed,
                                                            **sampling))
        eng.step()
        step += 1
        assert step < 10_000
    assert all(r.error is None for r in reqs.values()), [r.error for r in reqs.values()]
    return [reqs[i].token_ids for i in range(len(ps))]


def load(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("batch_size", 24)  # long prompts are prefilled in several chunks, beside others' decode steps
    kw.setdefault("kv_block", BLOCK)
    return colibri.load(path, **kw)


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_concurrent_greedy_equals_each_alone(tiny_model_dir, family):
    m = load(tiny_model_dir(family))
    ps, mts = prompts(), max_tokens()
    together = batched(m, ps, mts)
    assert m.engine.steps < max(mts) + len(ps) + 10  # they really ran together (alone: 198 steps)
    assert together == solo(m, ps, mts)


def test_concurrent_seeded_sampling_equals_each_alone(tiny_model_dir):
    m = load(tiny_model_dir("qwen3"))
    ps, mts = prompts(8), max_tokens(8)
    seeds = list(range(40, 48))
    kw = dict(temperature=0.9, top_p=0.95, top_k=50)
    alone = [m.generate(p, max_tokens=t, ignore_eos=True, seed=s, **kw).token_ids
             for p, t, s in zip(ps, mts, seeds)]
    assert batched(m, ps, mts, seeds=seeds, **kw) == alone
    assert len({tuple(a) for a in alone}) == len(alone)


def test_smollm2_concurrent_greedy_equals_each_alone():
    m = colibri.load(conv.default_container(), batch_size=32)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "List three primary colors:", "1, 2, 3, 4,", "The quick brown fox", "import numpy as np\n",
             "Water boils at"]
    ps = [m.tokenizer.encode(t) for t in texts]
    mts = [6, 12, 9, 4, 10, 7, 11, 5]
    assert batched(m, ps, mts, join=[0, 0, 1, 3, 3, 4, 6, 9]) == solo(m, ps, mts)


# ---------------------------------------------------------------------------------------------- streaming


@pytest.fixture(scope="module")
def containers(tiny_model_dir, tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("engine"), {}

    def get(family):
        if family not in cache:
            conv.convert(tiny_model_dir(family), root / family,
                         conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))
            cache[family] = root / family
        return cache[family]

    return get


def limit_for(path, fraction: float) -> int:
    placement, _, _ = colibri.runtime.model.plan(path, None, batch_size=24)
    return placement.minimum + int(fraction * placement.pinned_bytes)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2_moe"])
def test_concurrent_greedy_under_a_memory_limit(containers, family):
    path = containers(family)
    m = load(path, memory_limit=limit_for(path, 0.25), dtype=None)
    assert m.store.placement.streamed
    ps, mts = prompts(), max_tokens()
    assert batched(m, ps, mts) == solo(load(path, dtype=None), ps, mts)


def test_dense_step_reads_the_weights_once_for_all_sequences(containers):
    path = containers("llama")
    m = load(path, memory_limit=limit_for(path, 0.25), prefetch_depth=0, dtype=None)
    # the elastic budget would pin more for one short sequence than for eight: back to the placement's own pins
    # and held there, so both steps stream the same pages
    m.store.hold()
    streamed = m.store.streamed_bytes()
    assert streamed == m.store.placement.streamed_bytes > 0

    def decode_step_bytes(b: int) -> int:
        reqs = [m.engine.add_request(p[:8], SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts(b)]
        while any(not r.token_ids for r in reqs):
            m.engine.step()  # prefill until every one decodes
        assert len(m.engine.running) == b and all(r.pending == 1 for r in reqs)
        before = m.store.stats.bytes_read
        m.engine.step()
        got = m.store.stats.bytes_read - before
        for r in reqs:
            m.engine.abort(r)
        return got

    one, many = decode_step_bytes(1), decode_step_bytes(8)
    assert one == many == streamed


def test_moe_step_reads_the_union_of_routed_experts(containers):
    path = containers("qwen3_moe")
    m = load(path, memory_limit=limit_for(path, 0.0), prefetch_depth=0, dtype=None)
    store = m.store
    store.hold()  # the placement's own pins, held there (elastic pins would vary)
    assert store.placement.cache_slots == 0, "no expert cache: every routed expert is read for its step"
    pages = m.checkpoint.pages
    streamed = set(store.placement.streamed)
    dense = sum(pages[i].nbytes for i in streamed if pages[i].kind != "expert")
    expert_bytes = {}
    for i in streamed:
        if pages[i].kind == "expert":
            key = (pages[i].layer, pages[i].expert)
            expert_bytes[key] = expert_bytes.get(key, 0) + pages[i].nbytes
    routed: set = set()
    route = store.route

    def recording(i, uses, names):
        routed.update((i, e) for e in uses)
        return route(i, uses, names)

    store.route = recording
    reqs = [m.engine.add_request(p[:8], SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts(8)]
    while any(not r.token_ids for r in reqs):
        m.engine.step()
    assert len(m.engine.running) == 8
    for _ in range(3):
        routed.clear()
        before = store.stats.bytes_read
        m.engine.step()
        union = sum(expert_bytes.get(k, 0) for k in routed)
        assert store.stats.bytes_read - before == dense + union
        assert len(routed) < 8 * m.args.top_k * m.args.num_layers or m.args.num_experts <= m.args.top_k * 8


# ---------------------------------------------------------------------------------------------- the KV pool


def test_pool_spills_and_preempts_with_the_same_tokens(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    probe = load(path)
    lay = probe.kv_plan.layout
    ps, mts = prompts(), max_tokens()
    ref = solo(probe, ps, mts)
    # a 24-token RAM window per sequence (older blocks go to the swap file) in a pool that holds only a few
    # sequences' windows at once: the others wait, swapped out whole
    m = load(path, kv_ram=24 * lay.token_bytes, swap_dir=tmp_path / "swap")
    assert m.kv_plan.window == 24
    m.engine.memory.pool_bytes = 4 * (64 * lay.token_bytes)
    assert batched(m, ps, mts, join=[0] * N) == ref
    stats = m.stats()
    assert stats["preemptions"] > 0 and stats["kv_written_bytes"] > 0
    assert stats["running_sequences"] == stats["preempted_sequences"] == 0
    m.close()
    assert not list((tmp_path / "swap").glob("*")), "the temporary swap file is deleted on close"


def test_sequences_with_a_common_prompt_hold_its_blocks_once(tiny_model_dir):
    """One pool for sequences and the prefix cache: N sequences whose prompts share a long prefix hold that
    prefix's blocks once (the first computes them, the others reference them from the prefix cache), so the
    pool peaks near prefix + N * suffix, not N * whole; each decodes the tokens it decodes alone."""
    path = tiny_model_dir("llama")
    n, prefix_len, suffix_len, gen = 4, 24 * BLOCK, 5, 6
    common = tiny_models.token_ids(prefix_len, 384, seed=7)
    ps = [common + tiny_models.token_ids(suffix_len, 384, seed=200 + i) for i in range(n)]
    alone = load(path, batch_size=48)
    ref = []
    for p in ps:
        alone.kv.clear()  # nothing shared: each computed from scratch
        ref.append(alone.generate(p, max_tokens=gen, ignore_eos=True).token_ids)
    m = load(path, batch_size=48)
    eng, peak = m.engine, 0
    reqs = [eng.add_request(p, SamplingParams(max_tokens=gen, ignore_eos=True)) for p in ps]
    while any(not r.finished for r in reqs):
        eng.step()
        peak = max(peak, m.kv.pool.ram_blocks)
    assert [r.token_ids for r in reqs] == ref
    prefix_blocks, own = prefix_len // BLOCK, -(-(suffix_len + gen) // BLOCK) + 1  # +1: a straddled boundary
    assert peak <= prefix_blocks + n * own, (peak, prefix_blocks, own)
    assert peak < n * (prefix_blocks + own) // 2
    assert [r.metrics.prefix_tokens for r in reqs] == [0] + [prefix_len] * (n - 1)


def test_q8_and_sliding_window_layers_batch_exactly(tiny_model_dir, tmp_path):
    path = tiny_model_dir("gemma3")
    ps, mts = prompts(8), max_tokens(8)
    for kw in (dict(kv_quant="q8"), dict()):
        m = load(path, swap_dir=tmp_path / "swap", **kw)
        lay = m.kv_plan.layout
        m2 = load(path, swap_dir=tmp_path / "swap", kv_ram=16 * lay.token_bytes, **kw)  # windows offload
        assert batched(m2, ps, mts) == solo(m, ps, mts)


def test_a_request_that_cannot_fit_is_refused_alone(tiny_model_dir):
    m = load(tiny_model_dir("mistral"), ctx_length=64)
    ps, mts = prompts(4), max_tokens(4)
    ref = solo(m, ps, mts)
    eng = m.engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=t, ignore_eos=True)) for p, t in zip(ps, mts)]
    eng.step()
    with pytest.raises(InputError, match="prompt is 70 tokens but the context holds 64 with the reply; shorten the prompt"):
        eng.add_request(list(range(1, 71)), SamplingParams(max_tokens=4))
    eng.run(reqs)
    assert [r.token_ids for r in reqs] == ref


def test_abort_frees_the_sequence_and_the_others_continue(tiny_model_dir):
    m = load(tiny_model_dir("qwen2"), draft_tokens=0)  # one token per step: still running when aborted
    ps, mts = prompts(6), [12] * 6
    ref = solo(m, ps, mts)
    eng = m.engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=t, ignore_eos=True)) for p, t in zip(ps, mts)]
    for _ in range(6):
        eng.step()
    eng.abort(reqs[2])
    assert reqs[2].finish_reason == "abort" and reqs[2].cache is None
    eng.run(reqs)
    assert [r.token_ids for i, r in enumerate(reqs) if i != 2] == [t for i, t in enumerate(ref) if i != 2]
    assert reqs[2].token_ids == ref[2][:len(reqs[2].token_ids)]
    assert eng.counters()["running_sequences"] == 0


def test_stop_strings_and_finish_reasons_per_request(tiny_model_dir):
    m = load(tiny_model_dir("llama"))
    p = prompts(1)[0]
    r = m.generate(p, max_tokens=5, ignore_eos=True)
    assert r.finish_reason == "length" and len(r.token_ids) == 5
    eng = m.engine
    a = eng.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True))
    b = eng.add_request(p, SamplingParams(max_tokens=0))
    eng.run([a, b])
    assert a.token_ids == r.token_ids and b.finish_reason == "length" and b.token_ids == []
    assert a.metrics.ttft_s > 0 and a.metrics.generated_tokens == 5


def test_a_limit_too_tight_for_a_full_pass_prefills_in_shorter_chunks(containers):
    """--batch-size 512 under a limit that leaves room for the activations of a shorter pass only: the model
    loads with shorter passes (a long prompt is prefilled in more chunks), every pass stays within the reserve
    the limit holds, and the tokens are those of an unconstrained run."""
    path = containers("llama")
    full = colibri.runtime.model.plan(path, None, batch_size=512)[0].minimum
    short = colibri.runtime.model.plan(path, None, batch_size=16)[0].minimum
    assert short < full
    limit = (short + full) // 2
    m = load(path, memory_limit=limit, batch_size=512, dtype=None)
    assert 16 <= m.pass_tokens < 512 and m.reserve.batch == m.pass_tokens
    p = tiny_models.token_ids(m.context_length - 20, 384, seed=5)
    ref = load(path, batch_size=512, dtype=None).generate(p, max_tokens=6, ignore_eos=True).token_ids
    passes, forward = [], m.decoder.forward

    def counting(store, batch):
        passes.append(len(batch.tokens))
        return forward(store, batch)

    m.engine.decoder = type("Counting", (), {"forward": staticmethod(counting)})()
    assert m.generate(p, max_tokens=6, ignore_eos=True).token_ids == ref
    assert max(passes) <= m.pass_tokens and sum(n > 1 for n in passes) >= len(p) // m.pass_tokens
    assert m.store.placement.minimum <= limit < full  # the reserve for the passes run, and the weights' floor


def test_threads_share_the_engine(containers):
    """Two threads generating at once on a streaming store: serialized by the engine, each gets its own tokens."""
    path = containers("llama")
    m = load(path, memory_limit=limit_for(path, 0.25), dtype=None)
    ps, mts = prompts(4), [10] * 4
    ref = solo(m, ps, mts)
    got, errors = {}, []

    def work(i):
        try:
            got[i] = m.generate(ps[i], max_tokens=mts[i], ignore_eos=True).token_ids
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and [got[i] for i in range(4)] == ref


def test_engine_config_defaults_and_errors(tiny_model_dir):
    from colibri import cli
    cfg = EngineConfig()
    assert cfg.batch_size == 512 and cfg.max_sequences == 16 and cfg.kv_block is None
    assert SamplingParams().max_tokens == cli.OPTIONS["max_tokens"][0]["default"] == 256
    with pytest.raises(InputError, match="--max-sequences must be at least 1"):
        EngineConfig(max_sequences=0)
    with pytest.raises(InputError, match="unknown option"):
        colibri.load(tiny_model_dir("llama"), batch=3)
    args = cli.build_parser().parse_args(["run", "--prompt", "x", "--max-sequences", "3", "--batch-size", "7"])
    cfg = cli.engine_config(args)
    assert (cfg.max_sequences, cfg.batch_size) == (3, 7)


def test_drafts_are_verified_in_one_pass_and_rejected_ones_leave_the_kv(tiny_model_dir):
    """Speculation's engine side: a request's `draft` tokens ride in its next pass; those the model agrees with
    stand, the rest are dropped from the KV, and the tokens are those of plain decoding (the drafter is off: the
    drafts are the test's)."""
    m = load(tiny_model_dir("qwen2_moe"), draft_tokens=0)
    p = prompts(3)[2]
    ref = m.generate(p, max_tokens=16, ignore_eos=True).token_ids
    steps = {}
    for kind in ("right", "wrong"):
        eng = m.engine
        start = eng.steps
        req = eng.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True))
        while not req.finished:
            k = len(req.token_ids)
            if k and req.pending == 1:
                nxt = ref[k:min(k + 3, len(ref) - 1)]  # the last token ends the request: no draft after it
                req.draft = nxt if kind == "right" else [(t + 1) % 384 for t in nxt]
            eng.step()
        assert req.token_ids == ref, kind
        steps[kind] = eng.steps - start
        assert req.drafted > 0 and req.accepted == (req.drafted if kind == "right" else 0)
    assert steps["right"] < steps["wrong"] // 2
