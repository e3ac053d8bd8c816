"""Next-token choice over a batch of logits: the logits processors (min_tokens, logit_bias,
repetition / frequency / presence penalties), then greedy at temperature 0, else
temperature / top-k / top-p sampling; logprobs of the model's own distribution.

Randomness is keyed by (seed, position) so a request's samples do not depend on which
worker, batch or transport produced them: prefill samples the first token and decode the
rest, with the same result as if one process had done both.

A row whose logits hold no valid distribution (NaN, +inf, or nothing left after the
filters) gets None instead of a token: one bad row must not fail its batch neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.types import NO_HISTORY, SamplingParams, TokenHistory, TokenLogprob


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: TokenLogprob | None = None  # set when the row's params ask for logprobs


def _generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + position) % (2**63))
    return gen


def _padded(rows: list[tuple[int, ...]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor(
        [list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device
    ).reshape(len(rows), width)


def _counts(rows: list[tuple[int, ...]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] occurrences of each token id (the pad id `vocab` falls off the end)."""
    ids = _padded(rows, vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :vocab]


def _penalise(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]
) -> None:
    """Repetition (HF/vLLM: prompt + output; divide a positive logit, multiply a negative one),
    then frequency and presence (OpenAI: output only), over the rows that set any, in place."""
    rows = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    sub = logits[rows]
    output = _counts([histories[i].output_ids for i in rows], vocab, device)
    seen = (_counts([histories[i].prompt_ids for i in rows], vocab, device) + output) > 0
    column = lambda name: torch.tensor(
        [getattr(params[i], name) for i in rows], device=device
    ).unsqueeze(1)
    repetition = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub < 0, sub * repetition, sub / repetition), sub)
    sub = sub - column("frequency_penalty") * output - column("presence_penalty") * (output > 0)
    logits[rows] = sub


def process(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]
) -> torch.Tensor:
    """The logits processors, in vLLM's order: min_tokens, logit_bias, penalties. Returns
    `logits` itself when no row sets any, else a processed copy."""
    stops = [
        (row, t)
        for row, (p, h) in enumerate(zip(params, histories))
        if len(h.output_ids) < p.min_tokens
        for t in p.stop_token_ids
    ]
    biases = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
    if not stops and not biases and not any(p.needs_history for p in params):
        return logits
    logits = logits.clone()
    if stops:
        rows, ids = zip(*stops)
        logits[list(rows), list(ids)] = float("-inf")  # no ending before min_tokens
    if biases:
        rows, ids, values = zip(*biases)
        index = (torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))
        logits.index_put_(
            index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True
        )
    _penalise(logits, params, histories)
    return logits


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = (
            cumulative - sorted_logits.softmax(-1) >= params.top_p
        )  # keep the token that crosses p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _valid(probs: torch.Tensor) -> bool:
    return bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0


def _logprobs(
    raw: torch.Tensor, params: list[SamplingParams], tokens: list[int | None]
) -> list[TokenLogprob | None]:
    """Each asking row's chosen-token logprob and top k, from one batched log_softmax."""
    rows = [i for i, p in enumerate(params) if p.num_logprobs is not None and tokens[i] is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    logprobs = raw[rows].log_softmax(-1)
    chosen = (
        logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows], device=raw.device))
        .squeeze(1)
        .tolist()
    )
    k = max(params[i].num_logprobs for i in rows)
    top_values, top_ids = (t.tolist() for t in torch.topk(logprobs, min(k, raw.shape[-1])))
    for j, i in enumerate(rows):
        n = params[i].num_logprobs
        out[i] = TokenLogprob(chosen[j], tuple(zip(top_ids[j][:n], top_values[j][:n])))
    return out


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    histories: list[TokenHistory] | None = None,
) -> list[Sampled | None]:
    """One token per row of `logits` [batch, vocab] (None where the row cannot be sampled);
    `positions` index each row's new token, `histories` are what its penalties see."""
    raw = logits.float()
    finite = (~torch.isnan(raw) & (raw != float("inf"))).all(dim=-1).tolist()
    processed = process(raw, params, histories or [NO_HISTORY] * len(params))
    tokens: list[int | None] = [
        t if ok else None for t, ok in zip(processed.argmax(dim=-1).tolist(), finite)
    ]
    for row, (p, pos) in enumerate(zip(params, positions)):
        if p.greedy or tokens[row] is None:
            continue
        probs = _filter(processed[row], p).softmax(-1)
        if not _valid(probs):
            tokens[row] = None
            continue
        tokens[row] = int(
            torch.multinomial(probs, 1, generator=_generator(p.seed, pos, logits.device))
        )
    logprobs = _logprobs(raw, params, tokens)
    return [Sampled(t, lp) if t is not None else None for t, lp in zip(tokens, logprobs)]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    histories: list[TokenHistory] | None = None,
) -> list[int | None]:
    """Token ids only (see sample_rows)."""
    return [
        s.token_id if s is not None else None
        for s in sample_rows(logits, params, positions, histories)
    ]
