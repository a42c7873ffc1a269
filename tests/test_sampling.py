"""Sampler behaviour: greedy, seeds, top-k / top-p / min-p filtering, repetition penalty."""

from __future__ import annotations

import pytest
import torch

from colibri.core.errors import InputError
from colibri.engine.sampling import Sampler, SamplingParams


def draws(logits, n=400, **kw):
    s = Sampler(SamplingParams(seed=0, **kw))
    return [s(logits, []) for _ in range(n)]


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0))(LOGITS, []) == 0


def test_greedy_takes_torch_argmax_index_on_ties_nan_and_inf():
    """The greedy pick (numpy's argmax) is torch.argmax's: the first of equal maxima, a NaN as the largest."""
    s = Sampler(SamplingParams(temperature=0))
    g = torch.Generator().manual_seed(0)
    for case in range(300):
        v = torch.randint(-3, 3, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).float()
        if case % 3 == 0:
            v[int(torch.randint(0, v.numel(), (1,), generator=g))] = float("nan")
        if case % 5 == 0:
            v[int(torch.randint(0, v.numel(), (1,), generator=g))] = float("inf")
        if case % 7 == 0:
            v[:] = float("-inf")
        assert s(v, []) == int(torch.argmax(v))
    assert s(torch.zeros(8, 4)[:, 1], []) == 0  # a strided view


def test_seed_reproducible_and_distribution():
    a, b = draws(LOGITS, temperature=1.0), draws(LOGITS, temperature=1.0)
    assert a == b
    freq = torch.bincount(torch.tensor(a), minlength=4).float() / len(a)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.07)


def test_top_k_top_p_min_p_filter():
    assert set(draws(LOGITS, temperature=1.0, top_k=2)) <= {0, 1}
    assert set(draws(LOGITS, temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 + 0.3 reaches 0.7
    assert set(draws(LOGITS, temperature=1.0, top_p=0.5)) == {0}
    assert set(draws(LOGITS, temperature=1.0, min_p=0.5)) == {0, 1}  # keeps p >= 0.25


def test_repetition_penalty_discourages_seen_tokens():
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=10.0))
    assert s(torch.tensor([2.0, 1.0, -1.0]), [0]) == 1
    assert s(torch.tensor([-0.2, -2.5, -1.0]), [0]) == 2  # negative logits are multiplied


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(top_k=-1), dict(repetition_penalty=0), dict(max_tokens=-1)])
def test_invalid_params(bad):
    with pytest.raises(InputError):
        SamplingParams(**bad)
