"""Unit tests for actors.engine.sampling: greedy, seeded sampling, top-k and top-p."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from actors.engine.sampling import sample  # noqa: E402
from actors.types import SamplingParams  # noqa: E402

VOCAB = 50


def logits(rows: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def test_temperature_zero_is_argmax():
    x = logits(8, seed=1, scale=3.0)
    params = [SamplingParams(temperature=0.0, seed=s) for s in range(8)]
    assert sample(x, params, list(range(8))) == x.argmax(-1).tolist()


def test_greedy_ignores_top_k_top_p_and_seed():
    x = logits(4, seed=2)
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.3, seed=i) for i in range(4)]
    assert sample(x, params, [7, 8, 9, 10]) == x.argmax(-1).tolist()


def test_sampling_is_not_greedy():
    """With flat logits, seeded samples vary across positions (the test above means something)."""
    x = torch.zeros(1, VOCAB)
    p = SamplingParams(temperature=1.0, seed=3)
    picks = {sample(x, [p], [pos])[0] for pos in range(40)}
    assert len(picks) > 10


def test_same_seed_and_position_gives_same_sample():
    x = logits(1, seed=4)
    p = SamplingParams(temperature=1.5, seed=123)
    first = [sample(x, [p], [pos])[0] for pos in range(30)]
    again = [sample(x, [p], [pos])[0] for pos in range(30)]
    assert first == again
    assert len(set(first)) > 1, "different positions draw different randomness"
    other_seed = [
        sample(x, [SamplingParams(temperature=1.5, seed=124)], [pos])[0] for pos in range(30)
    ]
    assert other_seed != first


def test_sample_does_not_depend_on_batch_neighbours():
    row = logits(1, seed=5)[0]
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=77)
    alone = [sample(row.unsqueeze(0), [p], [pos])[0] for pos in range(20)]
    for trial in range(3):
        neighbours = logits(4, seed=100 + trial, scale=5.0)
        for slot in range(5):
            batch = torch.cat((neighbours[:slot], row.unsqueeze(0), neighbours[slot:]))
            params = [SamplingParams(temperature=0.7, seed=trial * 10 + i) for i in range(5)]
            params[slot] = p
            for pos in (0, 7, 19):
                positions = [pos + 3 * i for i in range(5)]
                positions[slot] = pos
                assert sample(batch, params, positions)[slot] == alone[pos]


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0, 100.0])
def test_top_k_one_is_argmax(temperature):
    x = logits(6, seed=6)
    params = [SamplingParams(temperature=temperature, top_k=1, seed=s) for s in range(6)]
    for pos in range(10):
        assert sample(x, params, [pos] * 6) == x.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token():
    x = logits(6, seed=7)
    params = [SamplingParams(temperature=2.0, top_p=1e-6, seed=s) for s in range(6)]
    for pos in range(10):
        assert sample(x, params, [pos] * 6) == x.argmax(-1).tolist()


@pytest.mark.parametrize("k", [2, 5])
def test_samples_come_only_from_top_k(k):
    x = logits(1, seed=8, scale=0.1)  # nearly flat: without the filter, picks would spread widely
    top = set(torch.topk(x[0], k).indices.tolist())
    p = SamplingParams(temperature=10.0, top_k=k, seed=9)
    picks = [sample(x, [p], [pos])[0] for pos in range(300)]
    assert set(picks) <= top
    assert set(picks) == top, "every top-k token should be reachable"


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 < 0.7 <= 0.8)
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    x = probs.log()
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    picks = {sample(x, [p], [pos])[0] for pos in range(300)}
    assert picks == {1, 3}


def test_top_k_and_top_p_combine():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.5, seed=2)
    picks = {sample(probs.log(), [p], [pos])[0] for pos in range(300)}
    assert picks == {0, 1}


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    p = SamplingParams(temperature=1.0, seed=11)
    picks = [sample(probs.log(), [p], [pos])[0] for pos in range(2000)]
    freq = [picks.count(i) / len(picks) for i in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.05)


@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_a_row_that_cannot_be_sampled_fails_alone(temperature):
    """Dividing by a denormal temperature overflows to inf: that row gets None, its
    neighbours (greedy and sampled) are untouched."""
    x = logits(3, seed=12, scale=3.0)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=temperature, seed=1),
        SamplingParams(temperature=1.0, seed=2),
    ]
    alone = sample(x[2:], params[2:], [5])[0]
    tokens = sample(x, params, [5, 5, 5])
    assert tokens == [int(x[0].argmax()), None, alone]


def test_non_finite_logits_fail_only_their_row():
    x = logits(2, seed=13)
    x[1, 3] = float("nan")
    assert sample(x, [SamplingParams(temperature=0.0)] * 2, [0, 0]) == [int(x[0].argmax()), None]
