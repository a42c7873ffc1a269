"""Real small models shipped on PyPI, checked against transformers loading the same GGUF file.

SmolLM2-135M runs by default; Qwen2.5-Coder-0.5B and Gemma-3-270m are marked slow.
"""

from __future__ import annotations

import math

import pytest
import torch

import colibri
import real_models

transformers = pytest.importorskip("transformers")

MODELS = [
    pytest.param("smollm2", id="smollm2"),
    pytest.param("qwen25", id="qwen2.5-coder-0.5b", marks=pytest.mark.slow),
    pytest.param("gemma3", id="gemma3-270m", marks=pytest.mark.slow),
]
PPL_TOKENS = 2048  # positions far past every other test's prompts; 4096 took over a minute of the suite


def gguf_path(name: str):
    p = {"smollm2": real_models.smollm2_gguf, "qwen25": real_models.qwen25_gguf, "gemma3": real_models.gemma3_gguf}[
        name]()
    if p is None:
        pytest.skip(f"{name} GGUF package not installed")
    return p


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """(name, colibri model, transformers model, transformers tokenizer) for one GGUF. Module-scoped and
    parametrized, so pytest runs every test of one model before loading the next."""
    name = request.param
    p = gguf_path(name)
    ours = colibri.load(p, dtype=torch.float32)
    ref, tok = real_models.hf_reference(p)
    yield name, ours, ref, tok
    ours.close()


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 through colibri alone, for behaviour tests that need no oracle."""
    m = colibri.load(gguf_path("smollm2"), dtype=torch.float32)
    yield m
    m.close()


def text_ids(ours, n: int) -> list[int]:
    ids = ours.tokenizer.encode(real_models.pydoc_text()[: n * 8])
    assert len(ids) >= n
    return ids[:n]


def test_logits_match(pair):
    _, ours, ref, _ = pair
    ids = text_ids(ours, 128)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    got = ours.logits(ids)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-3, f"max abs logit diff {diff}"


def test_greedy_matches(pair):
    _, ours, ref, _ = pair
    prompt = ours.tokenizer.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n")
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    got = ours.generate(prompt, max_tokens=32, temperature=0.0, ignore_eos=True).token_ids
    assert got == expected


def test_perplexity_matches(pair):
    _, ours, ref, _ = pair
    ids = text_ids(ours, PPL_TOKENS)
    target = torch.tensor(ids[1:])
    ppl_ours = math.exp(torch.nn.functional.cross_entropy(ours.logits(ids)[:-1], target).item())
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0, :-1].float()
    ppl_ref = math.exp(torch.nn.functional.cross_entropy(ref_logits, target).item())
    assert abs(ppl_ours - ppl_ref) / ppl_ref <= 1e-3, (ppl_ours, ppl_ref)


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And ünïcödé 日本語?"},
]


def test_chat_template_matches(pair):
    name, ours, _, tok = pair
    if name == "gemma3":
        pytest.skip("the Gemma-3-270m GGUF carries no chat template")
    for msgs in (CONVERSATION, CONVERSATION[1:2]):
        for gen_prompt in (True, False):
            expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
            assert ours.tokenizer.apply_chat_template(msgs, add_generation_prompt=gen_prompt) == expected
    expected_ids = tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
        expected_ids = expected_ids["input_ids"]
    assert ours.tokenizer.encode_chat(CONVERSATION) == list(expected_ids)


def test_streaming_text_equals_decode(smol):
    ours = smol
    tok = ours.tokenizer
    text = "Ünïcödé → 日本語のテキスト 🚀🎉 and emoji-heavy text: 👩‍👩‍👧 naïve café."
    ids = tok.encode(text, add_special_tokens=False)
    from colibri.formats.tokenizer import StreamDecoder

    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    r = ours.generate("Write one sentence in Japanese about cats:", max_tokens=24, temperature=0.8, seed=3)
    assert r.text == tok.decode(r.token_ids)


def test_stop_strings_and_eos(smol):
    ours = smol
    full = ours.generate("1, 2, 3, 4, 5,", max_tokens=24, ignore_eos=True)
    assert "8" in full.text
    cut = ours.generate("1, 2, 3, 4, 5,", max_tokens=24, stop=["8"], ignore_eos=True)
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index("8")]
    r = ours.chat([{"role": "user", "content": "Say hi."}], max_tokens=200)
    assert r.finish_reason == "stop" and 0 < len(r.token_ids) < 200  # the model ends its turn with EOS
    assert not set(r.token_ids) & set(ours.tokenizer.eos_ids)


def test_sampling_seed_reproducible(smol):
    ours = smol
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.1)
    a = ours.generate("Once upon a time", seed=7, **kw)
    b = ours.generate("Once upon a time", seed=7, **kw)
    c = ours.generate("Once upon a time", seed=8, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
