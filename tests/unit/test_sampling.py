"""Unit tests for actors.engine.sampling: greedy, seeded sampling, top-k and top-p, and the
batched sampler against the row-by-row one it replaced."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from actors.engine.sampling import Sampled, process, sample, sample_rows  # noqa: E402
from actors.types import SamplingParams, TokenHistory  # noqa: E402

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


def test_min_p_keeps_tokens_within_its_share_of_the_top_one():
    # 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps p >= 0.25 (the first two); neighbours unaffected
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    cut = SamplingParams(temperature=1.0, min_p=0.5, seed=3)
    free = SamplingParams(temperature=1.0, seed=3)
    picks = [sample(probs.log(), [cut, free], [pos, pos]) for pos in range(300)]
    assert {a for a, _ in picks} == {0, 1}
    assert {b for _, b in picks} == {0, 1, 2, 3}
    alone = [sample(probs[1:].log(), [free], [pos])[0] for pos in range(300)]
    assert alone == [b for _, b in picks]  # the min_p row leaves its neighbour's draws alone


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


# The sampler before it was batched (one row at a time, several device reads per step): the
# batched one must give exactly its tokens and logprobs, seeded rows included.
BEFORE_BATCHING = "11039f1"


@pytest.fixture(scope="module")
def before_batching():
    root = Path(__file__).resolve().parents[2]
    try:
        source = subprocess.run(
            ["git", "show", f"{BEFORE_BATCHING}:actors/engine/sampling.py"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(
            f"the sampler before batching is read from git ({BEFORE_BATCHING}), "
            f"not in this checkout's history: {error}"
        )
    name = "sampling_before_batching"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = module  # dataclasses look their module up
    try:
        exec(
            compile(source, f"{BEFORE_BATCHING}:actors/engine/sampling.py", "exec"), module.__dict__
        )
        yield module
    finally:
        del sys.modules[name]


def _exactly(rows, ties_in_any_order: bool = False) -> list[str]:
    """Sampled rows as text: repr of a float is exact (and -0.0 is not 0.0), NaN equals NaN,
    an id that became a float would show. `ties_in_any_order`: the top logprobs' values only
    (best first), not which of equally likely tokens hold them."""

    def row(s):
        if s is None:
            return None
        if s.logprob is None or not ties_in_any_order:
            return (s.token_id, s.logprob)
        return (s.token_id, s.logprob.logprob, [value for _, value in s.logprob.top])

    return [repr(row(s)) for s in rows]


def _k_set_by_a_failed_row(params, vocab: int, want) -> bool:
    """Whether the largest num_logprobs belongs only to rows that came out None. The sampler
    before batching took one topk at the largest k over the rows it had sampled; the batched
    one cannot know which those are without reading the device, so it takes the largest k over
    the rows that ask. topk picks among equal values differently for another k: in this case
    only, equally likely tokens among the top logprobs may differ (their values may not)."""
    asking = [i for i, p in enumerate(params) if p.num_logprobs is not None]
    sampled = [i for i in asking if want[i] is not None]
    k = lambda rows: min(max((params[i].num_logprobs for i in rows), default=0), vocab)
    return bool(sampled) and k(asking) > k(sampled)


def _random_batch(rng: random.Random, vocab: int):
    batch = rng.randint(1, 64)
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    x = torch.randn(batch, vocab, generator=gen) * rng.choice([0.1, 1.0, 3.0, 30.0])
    for row in range(batch):
        kind = rng.random()
        if kind < 0.05:
            x[row, rng.randrange(vocab)] = float("nan")
        elif kind < 0.1:
            x[row, rng.randrange(vocab)] = float("inf")
        elif kind < 0.15:
            x[row, rng.sample(range(vocab), max(1, vocab // 4))] = float("-inf")
        elif kind < 0.17:
            x[row] = float("-inf")  # finite by the check, no distribution
        elif kind < 0.2:
            x[row] = 0.0  # flat: every sort and top-k is a tie
        elif kind < 0.25:
            x[row] = x[row].round()  # many ties
    params, histories = [], []
    for _ in range(batch):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        cut = rng.randint(0, len(ids))
        histories.append(TokenHistory(tuple(ids[:cut]), tuple(ids[cut:])))
        penalised = rng.random() < 0.2
        params.append(
            SamplingParams(
                temperature=rng.choice([0.0, 0.0, 0.3, 0.7, 1.0, 1.0, 1.5, 100.0, 1e-38, 1e-45]),
                top_k=rng.choice([0, 0, 0, 1, 2, 5, vocab, vocab + 3]),
                top_p=rng.choice([1.0, 1.0, 1.0, 0.95, 0.9, 0.5, 1e-6, 0.0]),
                seed=rng.getrandbits(rng.choice([8, 40, 62])),
                stop_token_ids=tuple(rng.sample(range(vocab), min(vocab, 2))),
                min_tokens=rng.choice([0, 0, 0, 3, 20]),
                repetition_penalty=rng.choice([1.3, 0.8]) if penalised else 1.0,
                frequency_penalty=rng.choice([0.0, 0.5, -1.0]) if penalised else 0.0,
                presence_penalty=rng.choice([0.0, 1.5]) if penalised else 0.0,
                logit_bias=tuple(
                    (rng.randrange(vocab), rng.choice([-100.0, -1.5, 2.0, 100.0]))
                    for _ in range(rng.choice([0, 0, 0, 1, 3]))
                ),
                num_logprobs=rng.choice([None, None, None, 0, 1, 3, 5, vocab + 2]),
            )
        )
    positions = [rng.randrange(5000) for _ in range(batch)]
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
    return x.to(dtype), params, positions, histories


@pytest.mark.parametrize("vocab", [1, 3, 50, 257])
def test_batched_sampler_matches_the_one_before_exactly(before_batching, vocab):
    rng = random.Random(vocab)
    for _ in range(40):
        x, params, positions, histories = _random_batch(rng, vocab)
        for h in (histories, None):
            want = before_batching.sample_rows(x, params, positions, h)
            got = sample_rows(x, params, positions, h)
            ties = _k_set_by_a_failed_row(params, vocab, want)
            assert _exactly(got, ties) == _exactly(want, ties)
            assert all(type(s) is Sampled for s in got if s is not None)
        processed = process(x.float(), params, histories)
        torch.testing.assert_close(
            processed,
            before_batching.process(x.float(), params, histories),
            rtol=0,
            atol=0,
            equal_nan=True,
        )


def test_batched_sampler_matches_at_a_real_vocab(before_batching):
    """Seeded sampling over a 32k vocab, every row sampled: the case decode runs most."""
    rng = random.Random(7)
    x = torch.randn(16, 32000, generator=torch.Generator().manual_seed(3)) * 4
    for top_p, top_k in ((1.0, 0), (0.9, 0), (0.9, 40), (1.0, 50)):
        params = [
            SamplingParams(temperature=0.8, top_p=top_p, top_k=top_k, seed=rng.getrandbits(40))
            for _ in range(16)
        ]
        positions = [rng.randrange(4000) for _ in range(16)]
        want = before_batching.sample_rows(x, params, positions)
        assert _exactly(sample_rows(x, params, positions)) == _exactly(want)
