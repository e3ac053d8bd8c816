"""Next-token choice over a batch of logits: a constrained row's grammar mask, the logits
processors (min_tokens, logit_bias, repetition / frequency / presence penalties), then greedy
at temperature 0, else temperature / min-p / top-k / top-p sampling; logprobs of the model's own
distribution. A constrained row's matcher (actors/engine/grammar.py) then takes its token.

Randomness is keyed by (seed, position) so a request's samples do not depend on which
worker, batch or transport produced them: prefill samples the first token and decode the
rest, with the same result as if one process had done both.

A row whose logits hold no valid distribution (NaN, +inf, or nothing left after the
filters) gets None instead of a token: one bad row must not fail its batch neighbours.

Everything per row is a tensor operation over the batch, and the host reads the device once
per call: one tensor holding every row's token (-1 where the row cannot be sampled) and,
when a row asks, its logprobs. Greedy rows pay for an argmax only; the filters and the
draw run over the sub-batch of sampled rows. Host values reach the device without a
blocking copy (see `on_device`), the grammar bitmask too; a batch with no constrained row
makes no xgrammar call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from actors.engine import grammar
from actors.types import NO_HISTORY, SamplingParams, TokenHistory, TokenLogprob

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: TokenLogprob | None = None  # set when the row's params ask for logprobs


def on_device(
    device: torch.device, data: list | torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) as a tensor on `device`. On a GPU,
    `torch.tensor(..., device=...)` copies from pageable memory and waits for the stream; a
    pinned copy sent non-blocking does not (the caching host allocator keeps the pinned block
    until the copy is done)."""
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + position) % (2**63))
    return gen


def _padded(rows: list[tuple[int, ...]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return on_device(
        device, [list(r) + [pad] * (width - len(r)) for r in rows], torch.long
    ).reshape(len(rows), width)


def _counts(rows: list[tuple[int, ...]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] occurrences of each token id (the pad id `vocab` falls off the end)."""
    ids = _padded(rows, vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :vocab]


def _penalised(params: list[SamplingParams]) -> list[int]:
    """The rows that set a repetition, frequency or presence penalty."""
    return [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]


def _penalise(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory],
    rows: list[int],
) -> None:
    """Repetition (HF/vLLM: prompt + output; divide a positive logit, multiply a negative one),
    then frequency and presence (OpenAI: output only), over `rows`, in place."""
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    index = on_device(device, rows, torch.long)
    sub = logits.index_select(0, index)
    output = _counts([histories[i].output_ids for i in rows], vocab, device)
    seen = (_counts([histories[i].prompt_ids for i in rows], vocab, device) + output) > 0
    column = lambda name: on_device(device, [getattr(params[i], name) for i in rows]).unsqueeze(1)
    repetition = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub < 0, sub * repetition, sub / repetition), sub)
    sub = sub - column("frequency_penalty") * output - column("presence_penalty") * (output > 0)
    logits.index_copy_(0, index, sub)


def process(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory],
    *,
    owned: bool = False,
) -> torch.Tensor:
    """The logits processors, in vLLM's order: min_tokens, logit_bias, penalties. Returns
    `logits` itself when no row sets any, else a processed copy (`owned`: the caller's own
    copy, processed in place)."""
    stops = [
        (row, t)
        for row, (p, h) in enumerate(zip(params, histories))
        if len(h.output_ids) < p.min_tokens
        for t in p.stop_token_ids
    ]
    biases = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
    penalised = _penalised(params)
    if not stops and not biases and not penalised:
        return logits
    logits = logits if owned else logits.clone()
    device = logits.device
    if stops:
        rows, ids = zip(*stops)
        index = (on_device(device, rows, torch.long), on_device(device, ids, torch.long))
        logits.index_put_(index, logits.new_full((), _NEG_INF))  # no ending before min_tokens
    if biases:
        rows, ids, values = zip(*biases)
        index = (on_device(device, rows, torch.long), on_device(device, ids, torch.long))
        logits.index_put_(index, on_device(device, values, logits.dtype), accumulate=True)
    _penalise(logits, params, histories, penalised)
    return logits


def _on_rows(
    logits: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`logits` with `fn` applied to the rows `rows` (all of them, without gathering, when
    that is every row); never in place."""
    if len(rows) == logits.shape[0]:
        return fn(logits)
    index = on_device(logits.device, rows, torch.long)
    return logits.index_copy(0, index, fn(logits.index_select(0, index)))


def _min_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Per row with min_p > 0, tokens less likely than min_p x the top token's probability go
    to -inf (vLLM: after temperature, before top-k and top-p)."""
    rows = [r for r, p in enumerate(ps) if p > 0.0]
    if not rows:
        return logits

    def cut(sub: torch.Tensor) -> torch.Tensor:
        probs = sub.softmax(-1)
        floor = on_device(sub.device, [ps[r] for r in rows], torch.float32).unsqueeze(1)
        return sub.masked_fill(probs < probs.amax(-1, keepdim=True) * floor, _NEG_INF)

    return _on_rows(logits, rows, cut)


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Per row, everything below its k-th largest logit goes to -inf (k 0: the row is kept):
    one topk at the largest k, then each row's own k-th value."""
    rows = [r for r, k in enumerate(ks) if k > 0]
    if not rows:
        return logits
    ks = [min(ks[r], logits.shape[-1]) for r in rows]

    def cut(sub: torch.Tensor) -> torch.Tensor:
        kth = sub.topk(max(ks)).values.gather(
            1, on_device(sub.device, [k - 1 for k in ks], torch.long).unsqueeze(1)
        )
        return sub.masked_fill(sub < kth, _NEG_INF)

    return _on_rows(logits, rows, cut)


def _top_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Per row, the smallest set of most likely tokens whose probability reaches its p (the
    token that crosses p stays); one sort over the rows with p < 1."""
    rows = [r for r, p in enumerate(ps) if p < 1.0]
    if not rows:
        return logits

    def cut(sub: torch.Tensor) -> torch.Tensor:
        ordered, order = torch.sort(sub, dim=-1, descending=True)
        probs = ordered.softmax(-1)
        top_p = on_device(sub.device, [ps[r] for r in rows], torch.float32).unsqueeze(1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the token that crosses p
        return sub.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), _NEG_INF)

    return _on_rows(logits, rows, cut)


def _divide(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """`logits / temperature` per row, as the division by a Python float rounds on each
    device: on CPU a true division; on CUDA a product with the float32 reciprocal, which can
    differ in the last bit (and overflows to inf for a denormal temperature)."""
    if logits.device.type == "cuda":
        return logits * on_device(logits.device, 1.0 / temperatures)
    return logits / on_device(logits.device, temperatures)


def _draw(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's seeded sample after temperature, top-k and top-p, and whether the row held a
    valid distribution ([rows] long, [rows] bool; a row that did not drew an arbitrary token).

    The draw is torch.multinomial(probs, 1, generator)'s own algorithm (argmax of probs / q,
    q ~ Exp(1) filled from the row's generator), so tokens equal that call's for the same
    (seed, position), without its checks, which read the device; the noise needs one
    generator per row, the division and argmax run over the batch."""
    device = logits.device
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):  # x / 1.0 is x: all-ones rows skip the division
        logits = _divide(logits, torch.tensor(temperatures, dtype=torch.float32).unsqueeze(1))
    logits = _min_p(logits, [p.min_p for p in params])
    logits = _top_k(logits, [p.top_k for p in params])
    logits = _top_p(logits, [p.top_p for p in params])
    probs = logits.softmax(-1)
    valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    noise = torch.empty_like(probs)
    for row, (p, position) in enumerate(zip(params, positions)):
        noise[row].exponential_(1, generator=_generator(p.seed, position, device))
    return (probs / noise).argmax(dim=-1), valid


def _logprob_block(
    raw: torch.Tensor, asking: list[int], k: int, tokens: torch.Tensor
) -> torch.Tensor:
    """[len(asking), 1 + 2k] float64: each asking row's chosen-token logprob, its top k
    logprobs and their ids, from one batched log_softmax (float32 values and token ids are
    exact in float64). A row that came out None still counts towards k (which rows did is on
    the device): where it alone asked for the largest k, topk may pick another of equally
    likely tokens for its neighbours than a smaller k would (their values are the same)."""
    logprobs, chosen = raw, tokens
    if len(asking) != raw.shape[0]:
        index = on_device(raw.device, asking, torch.long)
        logprobs, chosen = raw.index_select(0, index), tokens.index_select(0, index)
    logprobs = logprobs.log_softmax(-1)
    picked = logprobs.gather(1, chosen.clamp(min=0).unsqueeze(1))  # a failed row's -1: unused
    top = torch.topk(logprobs, k)
    return torch.cat((picked.double(), top.values.double(), top.indices.double()), dim=1)


def _constrain(raw: torch.Tensor, matchers: list) -> torch.Tensor | None:
    """A copy of `raw` with each constrained row's grammar mask applied (free rows copied
    untouched), or None when no row is constrained or its mask restricts nothing. The
    bitmask is filled on the host and goes host -> device only."""
    found = grammar.row_bitmask(matchers, raw.shape[-1])
    if found is None:
        return None
    rows, bitmask = found[0], on_device(raw.device, found[1])
    if len(rows) == raw.shape[0]:
        masked = raw.clone()
        grammar.apply_bitmask(masked, bitmask)
        return masked
    index = on_device(raw.device, rows, torch.long)
    sub = raw.index_select(0, index)
    grammar.apply_bitmask(sub, bitmask)
    return raw.index_copy(0, index, sub)


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    histories: list[TokenHistory] | None = None,
    matchers: list | None = None,
) -> list[Sampled | None]:
    """One token per row of `logits` [batch, vocab] (None where the row cannot be sampled);
    `positions` index each row's new token, `histories` are what its penalties see, and
    `matchers` hold each constrained row's grammar matcher (None: a free row), which takes
    the row's token here (a token it refuses makes the row None)."""
    if not params:
        return []
    raw = logits.float()
    finite = raw.amax(dim=-1) < float("inf")  # no NaN (amax keeps it) and no +inf in the row
    masked = _constrain(raw, matchers) if matchers else None
    processed = process(
        raw if masked is None else masked,
        params,
        histories or [NO_HISTORY] * raw.shape[0],
        owned=masked is not None,
    )
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if len(drawn) == raw.shape[0]:
        tokens, valid = _draw(processed, params, positions)
        finite = finite & valid
    else:
        tokens = processed.argmax(dim=-1)
        if drawn:
            index = on_device(raw.device, drawn, torch.long)
            picks, valid = _draw(
                processed.index_select(0, index),
                [params[i] for i in drawn],
                [positions[i] for i in drawn],
            )
            tokens.index_copy_(0, index, picks)
            finite.index_copy_(0, index, finite.index_select(0, index) & valid)
    out = _read(raw, torch.where(finite, tokens, -1), params)
    if matchers:  # a token its matcher refuses fails the row (the mask left it nothing)
        for i in grammar.advance(matchers, [s.token_id if s else None for s in out]):
            out[i] = None
    return out


def _read(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list:
    """The rows' Sampled (None for a -1 token), with the logprobs they ask for, from `raw`
    (the model's own distribution): the one device read of the call."""
    batch, vocab = raw.shape
    asking = [i for i, p in enumerate(params) if p.num_logprobs is not None]
    if not asking:
        return [Sampled(t) if t >= 0 else None for t in tokens.tolist()]  # the one device read
    k = min(max(params[i].num_logprobs for i in asking), vocab)
    block = _logprob_block(raw, asking, k, tokens)
    values = torch.cat((tokens.double(), block.flatten())).tolist()  # the one device read
    out = [Sampled(int(t)) if t >= 0 else None for t in values[:batch]]
    width = 1 + 2 * k
    for j, i in enumerate(asking):
        if out[i] is None:
            continue
        row = values[batch + j * width : batch + (j + 1) * width]
        n = min(params[i].num_logprobs, k)
        top = tuple(zip((int(t) for t in row[1 + k : 1 + k + n]), row[1 : 1 + n]))
        out[i] = Sampled(out[i].token_id, TokenLogprob(row[0], top))
    return out


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    histories: list[TokenHistory] | None = None,
    matchers: list | None = None,
) -> list[int | None]:
    """Token ids only (see sample_rows)."""
    return [
        s.token_id if s is not None else None
        for s in sample_rows(logits, params, positions, histories, matchers)
    ]
