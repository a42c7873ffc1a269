"""The OpenAI sampling features in the engine (issue 26 item 1): presence / frequency penalties against a
reference computation, log-probabilities equal to log_softmax of Model.logits, n sequences of one prompt sharing
its KV blocks, and grammar-constrained JSON; each keeps the rule that batching never changes a sequence's tokens."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import colibri
import tiny_models
from colibri.core.errors import InputError
from colibri.engine.sampling import Sampler, SamplingParams, penalize

BLOCK = 4
PROMPT = tiny_models.token_ids(14, 384, seed=7)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m = colibri.load(tiny_model_dir("llama"), dtype="float32", batch_size=24, kv_block=BLOCK)
    yield m
    m.close()


def reference_penalized(logits: torch.Tensor, reply: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula, token by token: logit[j] -= count[j] * frequency + (count[j] > 0) * presence."""
    out = logits.clone()
    for j in set(reply):
        c = reply.count(j)
        out[j] -= c * frequency + presence
    return out


def test_penalize_matches_the_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    prompt, reply = [1, 2, 3, 3], [3, 4, 4, 4, 9, 1]
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3)
    got = penalize(logits, p, prompt + reply, len(prompt))
    assert torch.allclose(got, reference_penalized(logits, reply, 0.7, -0.3))
    assert torch.equal(penalize(logits, SamplingParams(), prompt + reply, len(prompt)), logits)  # off: untouched
    # the prompt's tokens are not the reply's: token 2 (prompt only) keeps its logit
    assert got[2] == logits[2]


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(logprobs=21),
                                 dict(logprobs=True), dict(presence_penalty=float("nan"))])
def test_invalid_penalty_and_logprobs_params(bad):
    with pytest.raises(InputError):
        SamplingParams(**bad)


def test_penalized_greedy_decoding_matches_the_reference(model):
    """The engine's penalized greedy tokens equal argmax of the reference formula over Model.logits."""
    kw = dict(presence_penalty=-2.0, frequency_penalty=0.7)  # pulls repeats in, then pushes them out
    got = model.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True, **kw).token_ids
    reply: list[int] = []
    for _ in range(12):
        logits = model.logits(PROMPT + reply)[-1]
        reply.append(int(torch.argmax(reference_penalized(logits, reply, **{
            "presence": kw["presence_penalty"], "frequency": kw["frequency_penalty"]}))))
    assert got == reply
    plain = model.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True).token_ids
    assert plain != got  # the penalties changed something: the test is not vacuous


def test_logprobs_are_log_softmax_of_model_logits(model):
    req = model.engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5))
    model.engine.run([req])
    chunks = [c for c in req.take() if c.token_id is not None]
    assert [c.token_id for c in chunks] == req.token_ids and len(chunks) == 8
    for k, c in enumerate(chunks):
        lp = torch.log_softmax(model.logits(PROMPT + req.token_ids[:k])[-1], dim=-1)
        assert c.logprobs.logprob == pytest.approx(float(lp[c.token_id]), abs=1e-5)
        top = torch.topk(lp, 5)
        assert [i for i, _ in c.logprobs.top] == top.indices.tolist()
        assert [v for _, v in c.logprobs.top] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert c.logprobs.top[0][0] == c.token_id  # greedy: the likeliest


def test_n_sequences_share_the_prompt_blocks_and_match_single_requests(model):
    """Three seeded sequences of one prompt, added together, give each one's single-request tokens, and the
    later two hold the first one's full prompt blocks (prefix cache) instead of computing their own."""
    prompt = tiny_models.token_ids(23, 384, seed=11)  # 5 full blocks of 4 and 3 tokens more
    kw = dict(max_tokens=10, temperature=0.9, top_p=0.95, ignore_eos=True, presence_penalty=0.5)
    eng = model.engine
    reqs = [eng.add_request(prompt, SamplingParams(seed=40 + j, **kw)) for j in range(3)]
    eng.run(reqs)
    full = len(prompt) // BLOCK * BLOCK
    assert [r.metrics.prefix_tokens for r in reqs[1:]] == [full, full]
    assert [r.metrics.prefill_computed for r in reqs[1:]] == [len(prompt) - full] * 2
    singles = [model.generate(prompt, seed=40 + j, **kw).token_ids for j in range(3)]
    assert [r.token_ids for r in reqs] == singles
    assert len({tuple(s) for s in singles}) > 1


def test_sampler_state_is_per_sequence():
    """A sampler reads only its own logits, context and seed: interleaving two never changes either's draws."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(20, 30, generator=g)
    p = dict(temperature=1.0, presence_penalty=0.4, frequency_penalty=0.2, logprobs=3)

    def run(order):
        samplers, ctx, out = [Sampler(SamplingParams(seed=s, **p), 2) for s in (1, 2)], [[5, 6], [7, 8]], [[], []]
        for who in order:  # a sequence's k-th draw reads its own k-th row of logits
            t = samplers[who](rows[10 * who + len(out[who])], ctx[who])
            ctx[who].append(t)
            out[who].append((t, samplers[who].last.logprob))
        return out

    a = run([0] * 10 + [1] * 10)
    b = run([0, 1] * 10)
    assert a == b


# -- grammar-constrained sampling -------------------------------------------------------------------------------

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "tag"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}}}


@pytest.fixture(scope="module")
def byte_model(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a byte-level tokenizer (256 byte tokens, EOS 256): a model that can write any text."""
    pytest.importorskip("llguidance")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    hf = tmp_path_factory.mktemp("byte_model") / "hf"
    shutil.copytree(tiny_model_dir("llama"), hf)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(hf / "tokenizer.json"))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    m = colibri.load(hf, dtype="float32", batch_size=24, kv_block=BLOCK)
    yield m
    m.close()


def test_json_schema_samples_validate_on_a_tiny_model(byte_model):
    import jsonschema
    from colibri.engine.grammar import json_schema_grammar
    g = json_schema_grammar(SCHEMA)
    eng, prompt = byte_model.engine, byte_model.prompt_ids("Say something:")
    reqs = [eng.add_request(prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=g))
            for s in range(20)]
    eng.run(reqs)  # batched together: each mask depends on its own tokens only
    for s, r in enumerate(reqs):
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert len({r.text for r in reqs}) > 5
    for s in (0, 7):  # batch invariance: alone, the same text
        alone = byte_model.generate(prompt, max_tokens=120, temperature=1.0, seed=s, grammar=g)
        assert alone.text == reqs[s].text


def test_a_grammar_that_does_not_compile_is_an_input_error(byte_model):
    from colibri.engine.grammar import json_schema_grammar
    with pytest.raises(InputError):
        byte_model.generate("x", max_tokens=3, grammar="start: ( unbalanced")
    with pytest.raises(InputError):
        json_schema_grammar(["not", "an", "object"])


# -- embeddings ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])
def test_embeddings_are_the_last_hidden_state_of_the_model_math(tiny_model_dir, family):
    """Model.embed: transformers' last_hidden_state (after the final norm) at the last token, unit length; the
    40-token input runs in two passes of 24."""
    path = tiny_model_dir(family)
    ids = tiny_models.token_ids(40, 384, seed=5)
    with colibri.load(path, dtype="float32", batch_size=24, kv_block=BLOCK) as m:
        got = m.embed(ids)
    ref = tiny_models.load_reference(path)
    with torch.no_grad():
        hidden = ref.model(torch.tensor([ids])).last_hidden_state[0, -1]
    assert got.shape == hidden.shape
    assert torch.allclose(got, torch.nn.functional.normalize(hidden, dim=0), atol=1e-5)
    assert float(got.norm()) == pytest.approx(1.0, abs=1e-5)
