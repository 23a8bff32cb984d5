"""Speculative sampling keeps the target distribution. Sampler.verify is run many times on fixed verify
logits (a small vocabulary, seeded): the first emitted token must follow row 0's distribution, and the token
after an accepted draft must follow row 1's. The bound is a chi-square test at p = 1e-4 (fails 1 in 10,000
runs by chance at most; the seed makes it deterministic), and the same test rejects a biased verifier (one
that keeps every draft), so it can fail."""

from __future__ import annotations

import torch

from expresslane.engine.decode.sampling import Sampler, SamplingParams

V = 8
TRIALS = 6000
CHI2_P1E4_DF7 = 29.88  # chi-square 0.9999 quantile, 7 degrees of freedom


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert (counts[~keep] == 0).all(), "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from expresslane.engine.decode.sampling import _top_k_top_p

    x = logits / params.temperature
    if params.top_k > 0 or params.top_p < 1:
        x = _top_k_top_p(x, params.top_k if params.top_k > 0 else 0, params.top_p if params.top_p < 1 else 0.0)
    return x.softmax(-1)


def _run(params: SamplingParams, logits: torch.Tensor, drafts: list[int], verify=None):
    sampler = Sampler(params, V, (), torch.device("cpu"))
    verify = verify or sampler.verify
    first = torch.zeros(V)
    second = torch.zeros(V)
    for _ in range(TRIALS):
        out = verify(logits, drafts, 1)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    return first, second


def _logits():
    g = torch.Generator().manual_seed(7)
    return torch.randn(3, V, generator=g) * 1.5


def test_rejection_sampling_keeps_the_target_distribution():
    logits = _logits()
    for params in (SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_k=5, seed=2),
                   SamplingParams(temperature=1.3, top_p=0.8, seed=3)):
        probs = _processed(logits, params)
        drafts = [int(probs[0].argmax()), int(probs[1].argsort()[-2])]  # a likely and a less likely draft
        first, second = _run(params, logits, drafts)
        assert _chi2(first, probs[0]) < CHI2_P1E4_DF7, (params, first, probs[0] * TRIALS)
        assert second.sum() > 1000
        assert _chi2(second, probs[1]) < CHI2_P1E4_DF7, (params, second, probs[1] * second.sum())


def test_the_bound_rejects_a_biased_verifier():
    """Keeping every draft (no rejection step) is the classic bug; the same test must catch it."""
    logits = _logits()
    params = SamplingParams(temperature=1.0, seed=4)
    probs = _processed(logits, params)
    drafts = [int(probs[0].argmax()), int(probs[1].argsort()[-2])]
    biased = lambda lg, d, n: list(d) + [0]  # noqa: E731
    first, _ = _run(params, logits, drafts, verify=biased)
    assert _chi2(first, probs[0]) > CHI2_P1E4_DF7


def test_greedy_verify_is_argmax_prefix():
    logits = _logits()
    s = Sampler(SamplingParams(), V, (), torch.device("cpu"))
    target = logits.argmax(-1).tolist()
    assert s.verify(logits, target[:2], 1) == target  # all kept + bonus
    wrong = (target[0] + 1) % V
    assert s.verify(logits, [wrong, target[1]], 1) == [target[0]]
