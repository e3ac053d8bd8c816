"""Unit tests for the logits processors and logprobs in actors/engine/sampling.py, against HF's
own processors where HF has the option, without Ray."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)  # noqa: E402

from actors.engine.sampling import process, sample, sample_rows  # noqa: E402
from actors.types import SamplingParams, TokenHistory  # noqa: E402

VOCAB = 40
EOS = 3


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def history(seed: int, prompt: int = 12, output: int = 7) -> TokenHistory:
    ids = torch.randint(
        0, VOCAB, (prompt + output,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    return TokenHistory(tuple(ids[:prompt]), tuple(ids[prompt:]))


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    x, histories = logits(3, seed=1), [history(s) for s in range(3)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=penalty)] * 3
    input_ids = torch.tensor([list(h.prompt_ids + h.output_ids) for h in histories])
    want = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, x.clone())
    assert torch.equal(process(x, params, histories), want)


def test_min_tokens_matches_hf_min_new_tokens():
    x = logits(1, seed=2)
    x[0, EOS] = 50.0  # EOS is the model's choice
    h = history(3, prompt=5, output=2)
    prompt_len = len(h.prompt_ids)
    input_ids = torch.tensor([list(h.prompt_ids + h.output_ids)])
    for min_tokens in (0, 2, 3, 6):
        params = [SamplingParams(temperature=0.0, min_tokens=min_tokens, stop_token_ids=(EOS,))]
        hf = MinNewTokensLengthLogitsProcessor(prompt_len, min_tokens, EOS)(input_ids, x.clone())
        assert torch.equal(process(x, params, [h]), hf)
        assert (sample(x, params, [7], [h])[0] == EOS) == (min_tokens <= 2)


def test_frequency_and_presence_penalties_follow_openai():
    x, h = logits(1, seed=4), TokenHistory((5, 5, 6), (7, 7, 7, 8))
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.5)]
    out = process(x, params, [h])
    want = x.clone()
    want[0, 7] -= 0.5 * 3 + 1.5
    want[0, 8] -= 0.5 * 1 + 1.5
    assert torch.allclose(out, want), "output tokens only: the prompt's 5 and 6 are untouched"


def test_logit_bias_bans_and_forces():
    x = logits(2, seed=5)
    top = int(x[0].argmax())
    banned = SamplingParams(temperature=0.0, logit_bias=((top, -100.0),))
    forced = SamplingParams(temperature=0.0, logit_bias=((11, 100.0),))
    tokens = sample(x, [banned, forced], [0, 0])
    assert tokens[0] != top and tokens[0] == int(x[0].topk(2).indices[1]) and tokens[1] == 11
    assert torch.equal(process(x, [SamplingParams()] * 2, [TokenHistory()] * 2), x), (
        "no processor: untouched"
    )


def test_penalties_change_greedy_output():
    x = logits(1, seed=6)
    top = int(x[0].argmax())
    h = TokenHistory((), (top,) * 3)
    assert sample(x, [SamplingParams(temperature=0.0)], [0], [h]) == [top]
    assert sample(x, [SamplingParams(temperature=0.0, frequency_penalty=2.0)], [0], [h]) != [top]


def test_mixed_batch_rows_match_each_row_alone():
    x, histories = logits(5, seed=7), [history(10 + s, output=s) for s in range(5)]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=1, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=1.0, logit_bias=((4, 5.0),)),
        SamplingParams(
            temperature=1.0, seed=2, min_tokens=9, stop_token_ids=(EOS,), num_logprobs=3
        ),
        SamplingParams(temperature=0.0, frequency_penalty=-1.0, num_logprobs=0),
    ]
    together = sample_rows(x, params, [9] * 5, histories)
    alone = [
        sample_rows(x[i : i + 1], params[i : i + 1], [9], histories[i : i + 1])[0] for i in range(5)
    ]
    assert together == alone


def test_logprobs_are_the_model_distribution():
    x = logits(2, seed=8)
    params = [SamplingParams(temperature=0.0, num_logprobs=4), SamplingParams(temperature=0.0)]
    first, second = sample_rows(x, params, [0, 0])
    want = x[0].log_softmax(-1)
    assert first.token_id == int(x[0].argmax())
    assert first.logprob.logprob == pytest.approx(float(want.max()))
    assert [t for t, _ in first.logprob.top] == want.topk(4).indices.tolist()
    assert [v for _, v in first.logprob.top] == pytest.approx(want.topk(4).values.tolist())
    assert second.logprob is None
    zero = sample_rows(x[:1], [SamplingParams(temperature=0.0, num_logprobs=0)], [0])[0]
    assert zero.logprob.top == () and zero.logprob.logprob == pytest.approx(float(want.max()))


def test_a_non_finite_row_with_penalties_fails_alone():
    x = logits(3, seed=9)
    x[1, 2] = float("nan")
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2, num_logprobs=2)] * 3
    h = [history(s) for s in range(3)]
    out = sample_rows(x, params, [0] * 3, h)
    assert out[1] is None and out[0] == sample_rows(x[:1], params[:1], [0], h[:1])[0]
    assert out[2] == sample_rows(x[2:], params[2:], [0], h[2:])[0]
