"""Speculative decoding and MoE router lookahead change how many tokens a weight sweep yields, never the tokens:
greedy output with drafts equals plain decoding, seeded sampling keeps the model's distribution, and the
lookahead's guesses only move reads earlier."""

from __future__ import annotations

import json

import pytest
import torch

import colibri
import colibri.runtime.model
import tiny_models
from colibri.convert import pipeline as conv
from colibri.engine.speculate import NgramCache, PassCost, SequenceDrafts, Speculator
from colibri.core.errors import InputError
from colibri.engine.sampling import SamplingParams

from test_engine import batched, load


def repetitive(n: int, vocab: int, seed: int) -> list[int]:
    """A prompt that repeats a random phrase with small edits (what code and documents look like to a drafter)."""
    phrase = tiny_models.token_ids(9, vocab, seed)
    out = []
    for r in range(n // 9 + 1):
        out += phrase[:4] + [(phrase[4] + r) % vocab] + phrase[5:]
    return out[:n]


def prompt_set(vocab: int = 384) -> list[list[int]]:
    """Four repetitive and four random prompts."""
    return ([repetitive(20 + 7 * i, vocab, seed=200 + i) for i in range(4)]
            + [tiny_models.token_ids(12 + 5 * i, vocab, seed=300 + i) for i in range(4)])


def spec_totals(m) -> tuple[int, int]:
    c = m.engine.counters()
    return c["spec_drafted_tokens"], c["spec_accepted_tokens"]


# ---------------------------------------------------------------------------------------------- the drafter


def test_prompt_lookup_takes_the_longest_most_recent_match():
    st = SequenceDrafts(3)
    ids = [5, 1, 2, 3, 9, 1, 2, 3, 4, 7, 2, 3]
    st.extend_index(ids)
    sp = Speculator(draft_tokens=4, ngram=3, cache_entries=0)
    assert sp._match(st, ids)[0] == 2 and sp._match(st, ids)[2] == 8  # "2 3" last seen before 4
    sp.seqs[1] = st

    class Req:
        id = 1
    req = Req()
    req.ids = ids
    assert sp.propose(req, 4, 1) == [4, 7, 2, 3]
    req.ids = [1, 2, 1, 2, 1]  # the draft runs past the end of the context: it continues itself
    sp.seqs.clear()
    assert sp.propose(req, 9, 1) == [2, 1, 2, 1]  # 4: the fixed length


def test_ngram_cache_is_shared_and_bounded():
    cache = NgramCache(entries=50, ngram=3)
    cache.add(list(range(100)))
    assert len(cache) == 50
    assert cache.lookup((97, 98)) == (tuple(range(100)), 99) and cache.lookup((3, 4)) is None
    sp = Speculator(draft_tokens=3, ngram=3, cache_entries=1000)

    class Req:
        def __init__(self, rid, ids):
            self.id, self.ids, self.token_ids = rid, ids, ids[-1:]
    sp.finished(Req(1, [10, 11, 12, 13, 14, 15]))
    assert sp.propose(Req(2, [7, 11, 12]), 3, 2) == [13, 14, 15]  # another sequence's text


def test_gate_drafts_when_a_pass_costs_the_same_and_stops_when_compute_bound():
    def gate(seconds, accept):
        sp = Speculator(cache_entries=0)
        for t in (1, 2, 4, 8):
            for _ in range(4):
                sp.measured(t, seconds(t))
        st = SequenceDrafts(2)
        st.accept[1] = [accept * 10, 10.0]
        return sp._gate(st, 1, 1)

    streamed = lambda t: 0.4 + 0.002 * t  # noqa: E731 - one sweep of the disk dominates
    compute = lambda t: 0.01 * t  # noqa: E731 - every token costs the same
    assert gate(streamed, 0.6) >= 8
    assert gate(compute, 0.6) == 0 and gate(compute, 0.95) == 0
    mixed = lambda t: 0.06 + 0.01 * t  # noqa: E731 - all in RAM, memory-bound decode: some drafts pay
    assert 0 < gate(mixed, 0.8) < gate(streamed, 0.8)
    a, b = PassCost().line() or (None, None)
    assert a is None


def test_options_are_checked(tiny_model_dir):
    with pytest.raises(InputError, match="--draft-tokens"):
        colibri.load(tiny_model_dir("llama"), draft_tokens=-1)
    with pytest.raises(InputError, match="--ngram must"):
        colibri.load(tiny_model_dir("llama"), ngram=0)
    from colibri import cli
    args = cli.build_parser().parse_args(["run", "--prompt", "x", "--draft-tokens", "0", "--ngram", "3",
                                          "--ngram-cache-size", "10", "--no-lookahead"])
    cfg = cli.engine_config(args)
    assert (cfg.draft_tokens, cfg.ngram, cfg.ngram_cache_size, cfg.lookahead) == (0, 3, 10, False)


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("family,draft", [("llama", 4), ("qwen2_moe", 3)])  # fixed: the gate times passes
def test_greedy_with_drafts_equals_plain_decoding(tiny_model_dir, family, draft):
    ps = prompt_set()
    mts = [24] * len(ps)
    off = load(tiny_model_dir(family), draft_tokens=0)
    ref = [off.generate(p, max_tokens=t, ignore_eos=True).token_ids for p, t in zip(ps, mts)]
    on = load(tiny_model_dir(family), draft_tokens=draft, max_sequences=8)
    alone = [on.generate(p, max_tokens=t, ignore_eos=True) for p, t in zip(ps, mts)]
    assert [r.token_ids for r in alone] == ref
    assert sum(r.stats["draft_tokens"] for r in alone) > 0  # drafts were made (a random model rarely copies)
    # 8 sequences drafting in the same passes; the shared n-gram cache has seen these replies: most drafts stand
    assert batched(on, ps, mts, join=[0] * len(ps)) == ref
    drafted, accepted = spec_totals(on)
    assert drafted > accepted > drafted // 3
    assert on.engine.counters()["tokens_per_pass"] > 1.2  # both runs together


def test_smollm2_greedy_with_drafts_equals_plain_decoding():
    texts = ["Copy the list.\nred, green, blue, yellow, orange, purple, white, black\nred, green, blue,",
             "Once upon a time, in a small village,"]
    on = colibri.load(conv.default_container(), max_sequences=8, draft_tokens=6)
    ps = [on.tokenizer.encode(t) for t in texts]
    drafter, on.engine.spec = on.engine.spec, Speculator(draft_tokens=0)  # one load: plain decoding first
    ref = [on.generate(p, max_tokens=10, ignore_eos=True).token_ids for p in ps]
    on.engine.spec = drafter
    alone = [on.generate(p, max_tokens=10, ignore_eos=True) for p in ps]
    assert [r.token_ids for r in alone] == ref
    assert alone[0].stats["tokens_per_pass"] > 1.5  # the list repeats from the prompt
    ps8 = [ps[i % 2] for i in range(8)]
    assert batched(on, ps8, [10] * 8, join=[0] * 8) == [ref[i % 2] for i in range(8)]
    on.close()


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny llama with a vocabulary of 8 (so samples repeat n-grams and drafts are checked often)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)  # next-token probabilities ~0.02-0.4
    path = tmp_path_factory.mktemp("vocab8") / "llama8"
    model.save_pretrained(path)
    return path


def first_tokens(m, prompt, seeds, n):
    reqs = [m.engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True))
            for s in seeds]
    m.engine.run(reqs)
    return [tuple(r.token_ids) for r in reqs]


def chi_square_p(a: list, b: list) -> float:
    """Two-sample chi-square test of homogeneity (equal sample sizes) over the values seen; its p-value."""
    cells = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cells], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cells], dtype=torch.float64)
    stat = float(((ca - cb) ** 2 / (ca + cb)).sum())
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_seeded_sampling_keeps_the_distribution(small_vocab):
    """Spec on and off, 400 samples each with disjoint fixed seeds: the first four tokens' distributions agree
    (chi-square at 0.001 per position: fixed seeds, so the outcome is fixed); a seed gives the same tokens with
    speculation on or off (one random draw per emitted token in both)."""
    prompt = tiny_models.token_ids(24, 8, seed=5)  # every token of the vocabulary, most pairs: drafts match
    n, k = 400, 4
    # a pass holds every sequence's prompt at once: drafts ride only in the room prompt chunks leave
    on = load(small_vocab, draft_tokens=3, max_sequences=32, batch_size=1024)
    off = load(small_vocab, draft_tokens=0, max_sequences=32, batch_size=1024)
    s_on = first_tokens(on, prompt, range(n), k)
    s_off = first_tokens(off, prompt, range(10_000, 10_000 + n), k)
    drafted, accepted = spec_totals(on)
    assert drafted > 2 * accepted > 0, (drafted, accepted)  # drafts were verified, and rejected too: both paths of the rule ran
    for j in range(k):
        p = chi_square_p([s[j] for s in s_on], [s[j] for s in s_off])
        assert p > 0.001, (j, p)
    assert len(set(s_on)) > 50  # really sampled
    assert first_tokens(off, prompt, range(64), k) == s_on[:64]
    assert first_tokens(on, prompt, range(10_000, 10_064), k) == s_off[:64]


# ---------------------------------------------------------------------------------------------- MoE lookahead


@pytest.fixture(scope="module")
def correlated_moe(tmp_path_factory):
    """A q4 container of a 4-layer, 8-expert top-2 Mixtral whose layers route alike: one router and FFN norm
    shared by every layer, and attention and experts that move the residual stream little."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(11)
    cfg = MixtralConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        num_local_experts=8, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
                        pad_token_id=None)
    model = MixtralForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(11)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.2 * noise)
        for i in range(1, 4):
            for part in ("mlp.gate.weight", "post_attention_layernorm.weight"):
                params[f"model.layers.{i}.{part}"].copy_(params[f"model.layers.0.{part}"])
        for name, p in params.items():
            if "o_proj" in name or "down_proj" in name:
                p.mul_(0.01)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(5.0)  # decisive routing
    root = tmp_path_factory.mktemp("moe_corr")
    model.save_pretrained(root / "hf")
    conv.convert(root / "hf", root / "q4", conv.ConvertOptions(quant="q4", group_size=32, page_size_mb=1))
    return root / "q4"


def test_router_lookahead_guesses_the_next_layer_and_never_changes_tokens(correlated_moe):
    path = correlated_moe
    placement, _, _ = colibri.runtime.model.plan(path, None, batch_size=24)
    ps = prompt_set()[4:]
    runs = {}
    for look in (True, False):
        # attention pages pinned, experts streamed through a small expert cache
        m = load(path, memory_limit=placement.minimum + int(0.3 * placement.pinned_bytes), dtype=None,
                 lookahead=look, draft_tokens=0)
        assert any(m.checkpoint.pages[i].kind == "expert" for i in m.store.placement.streamed)
        rs = [m.generate(p, max_tokens=8, ignore_eos=True) for p in ps[:2]]
        together = batched(m, ps, [8] * len(ps), join=[0] * len(ps))
        runs[look] = ([r.token_ids for r in rs], together, m.engine.counters(),
                      m.store.counters()["lookahead_recall_by_layer"], rs[0].stats)
        m.close()
    on, off = runs[True], runs[False]
    assert on[0] == off[0] == on[1][:2] and on[1] == off[1]
    c = on[2]
    assert c["lookahead_reads"] > 0 and c["lookahead_recall"] >= 0.75, c
    assert 0 < c["lookahead_useful_reads"] <= c["lookahead_reads"], c  # guesses that the layer then used
    by_layer = on[3]
    assert by_layer[0] is None and all(r >= 0.6 for r in by_layer[1:]), by_layer  # layer 0 has no guess
    assert on[4]["lookahead_recall"] >= 0.6 and "expert_hit_rate" in on[4]
    assert off[2].get("lookahead_predicted", 0) == 0
    json.dumps(c)  # every counter is a plain number
    assert all(isinstance(v, (int, float)) for v in c.values())


def test_drafts_are_cut_rather_than_unpin_weights(correlated_moe):
    """Under a limit a pass carrying drafts must fit beside the weights as pinned now; drafts that do not are cut
    (the tokens stay those of plain decoding)."""
    placement, _, _ = colibri.runtime.model.plan(correlated_moe, None, batch_size=24)
    m = load(correlated_moe, dtype=None, draft_tokens=4,
             memory_limit=placement.minimum + int(0.3 * placement.pinned_bytes))
    assert m.store.spare(0) is not None
    prompt = prompt_set()[0]  # repetitive: prompt lookup finds matches
    drafter, m.engine.spec = m.engine.spec, Speculator(draft_tokens=0)  # one load: plain decoding first
    ref = m.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
    m.engine.spec = drafter
    m.store.spare = lambda held: -1  # no room for anything beyond what is pinned: every draft goes
    assert m.generate(prompt, max_tokens=8, ignore_eos=True).token_ids == ref
    c = m.engine.counters()
    assert c["spec_drafted_tokens"] == 0 and c["spec_cut_for_memory_tokens"] > 0, c
    m.close()


def test_drafter_memory_estimate_bounds_what_it_allocates():
    """The engine counts the drafter's indexes in the KV pool's budget by `nbytes()`: it must not undercount."""
    import random
    import tracemalloc

    rng = random.Random(5)
    for n in (1, 4, 8):
        ids = [rng.randrange(50000) for _ in range(2000)]
        tracemalloc.start()
        st = SequenceDrafts(n)
        st.extend_index(ids)
        used = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert used <= st.nbytes(), (n, used, st.nbytes())
    tracemalloc.start()
    cache = NgramCache(20000, 4)
    for _ in range(12):
        cache.add([rng.randrange(50000) for _ in range(1500)])
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(cache) == 20000 and used <= cache.nbytes(), (used, cache.nbytes())


def test_metrics_export_speculation_and_lookahead_recall_per_layer():
    """/metrics carries the engine's speculation counters as gauges and the lookahead's recall per layer."""
    from colibri.server.metrics import ServerMetrics

    class Worker:
        state = "ready"
        snapshot = {"queued": 0, "kv_pool_capacity_bytes": 0, "kv": {},
                    "engine": {"spec_drafted_tokens": 5, "spec_acceptance_rate": 0.4, "lookahead_recall": 0.625},
                    "store": {"expert_hits": 1, "expert_misses": 3, "lookahead_recall_by_layer": [None, 0.5, 0.75]}}

        def rates(self):
            return 0.0, 0.0

        def in_flight(self):
            return 0

    metrics = ServerMetrics()
    metrics.attach(Worker())
    text = metrics.render().decode()
    for line in ('colibri_lookahead_recall_by_layer{layer="1"} 0.5', 'colibri_lookahead_recall_by_layer{layer="2"} 0.75',
                 "colibri_engine_spec_drafted_tokens 5.0", "colibri_engine_spec_acceptance_rate 0.4",
                 "colibri_engine_lookahead_recall 0.625", "colibri_expert_hit_rate 0.25"):
        assert line in text, line
    assert 'layer="0"' not in text  # layer 0 has no guess
