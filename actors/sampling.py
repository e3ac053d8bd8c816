"""Next-token choice: greedy at temperature 0, else temperature / top-k / top-p sampling.

Randomness is keyed by (seed, position) so a request's samples do not depend on which
worker, batch or transport produced them: prefill samples the first token and decode the
rest, with the same result as if one process had done both.

A row whose logits hold no valid distribution (NaN, +inf, or nothing left after the
filters) gets None instead of a token: one bad row must not fail its batch neighbours.
"""
from __future__ import annotations

import torch

from actors.types import SamplingParams


def _generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + position) % (2**63))
    return gen


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep the token that crosses p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _valid(probs: torch.Tensor) -> bool:
    return bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int | None]:
    """One token per row of `logits` [batch, vocab] (None where the row cannot be sampled);
    `positions` index each row's new token."""
    finite = (~torch.isnan(logits) & (logits != float("inf"))).all(dim=-1).tolist()
    tokens: list[int | None] = [t if ok else None for t, ok in zip(logits.argmax(dim=-1).tolist(), finite)]
    for row, (p, pos) in enumerate(zip(params, positions)):
        if p.greedy or tokens[row] is None:
            continue
        probs = _filter(logits[row].float(), p).softmax(-1)
        if not _valid(probs):
            tokens[row] = None
            continue
        gen = _generator(p.seed, pos, logits.device)
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen))
    return tokens
