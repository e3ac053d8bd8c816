"""The sampler reads the device once per step (its tokens, with any logprobs): counted on CPU
with actors/engine/host_syncs.py, which sees the calls that would make a GPU's host wait."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from actors.engine.host_syncs import counting_syncs  # noqa: E402
from actors.engine.sampling import sample_rows  # noqa: E402
from actors.types import SamplingParams, TokenHistory  # noqa: E402

BATCH, VOCAB = 32, 1000


def logits() -> torch.Tensor:
    return torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t[0].item(),
        lambda t: bool(t[0]),
        lambda t: int(t[0]),
        lambda t: float(t.sum()),
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: t.nonzero(),
    ],
    ids=["item", "bool", "int", "float", "tolist", "numpy", "nonzero"],
)
def test_the_counter_counts_each_device_read_once(read):
    t = torch.arange(5.0)
    with counting_syncs() as counts:
        read(t)
    assert sum(counts.values()) == 1, counts


def test_the_counter_sees_nothing_in_device_only_work():
    t = torch.arange(5.0)
    with counting_syncs() as counts:
        torch.where(t > 2, t, -1).softmax(-1).argmax().clamp(min=0)
    assert not counts


def syncs(params, positions=None, histories=None) -> dict:
    x = logits()
    with counting_syncs() as counts:
        out = sample_rows(x, params, positions or list(range(len(params))), histories)
    assert len(out) == len(params)
    return dict(counts)


def mixed(**extra) -> list[SamplingParams]:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.7, top_k=50, top_p=0.95),
        dict(temperature=1e-45),  # cannot be sampled: None, found on the device
    ]
    return [SamplingParams(seed=i, **kinds[i % len(kinds)], **extra) for i in range(BATCH)]


def test_all_greedy_reads_once():
    assert syncs([SamplingParams(temperature=0.0)] * BATCH) == {"tolist": 1}


def test_seeded_sampling_reads_once():
    assert syncs([SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(BATCH)]) == {
        "tolist": 1
    }
    assert syncs(mixed()) == {"tolist": 1}


def test_logprobs_read_with_the_tokens():
    assert syncs([SamplingParams(temperature=0.0, num_logprobs=5)] * BATCH) == {"tolist": 1}
    assert syncs(mixed(num_logprobs=3)) == {"tolist": 1}


def test_processors_and_bad_rows_add_no_read():
    params = [
        SamplingParams(
            temperature=[0.0, 0.9][i % 2],
            seed=i,
            min_tokens=4,
            stop_token_ids=(1, 2),
            logit_bias=((7, 5.0), (8, -100.0)),
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            num_logprobs=[None, 2][i % 2],
        )
        for i in range(BATCH)
    ]
    histories = [TokenHistory((1, 2, 3, i), (4, 5, 5)) for i in range(BATCH)]
    x = logits()
    x[3, 5] = float("nan")
    x[4, 6] = float("inf")
    with counting_syncs() as counts:
        out = sample_rows(x, params, list(range(BATCH)), histories)
    assert counts == {"tolist": 1}
    assert out[3] is None and out[4] is None
