"""Constrained decoding's cost in the decode engine (no Ray): step time of one batch with
0, half or all rows held to a JSON schema, and whether the free rows' tokens moved.

The constrained rows' schema is an object with one free string, so a row stays in the batch
(a random or weak model rarely closes the string) and each step fills a real mask. Their
first token is `{`, as prefill would have sampled under the grammar.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import AutoTokenizer

from actors.engine.decode import DecodeEngine
from actors.engine.lm_runner import LMRunner
from actors.types import DecodeRequest, GrammarSpec, SamplingParams
from benchkit.decode_engine import WARMUP_STEPS, _prompt_kv, _sync
from router.worker_settings import DecodeSettings

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def _run(runner, packed, first, brace, batch, num_constrained, steps):
    """(step ms of `steps` timed steps, free rows' tokens) with `num_constrained` rows held."""
    engine = DecodeEngine(runner, DecodeSettings(max_batch_size=batch), max_model_len=1 << 20)
    free = SamplingParams(temperature=0.0, max_tokens=WARMUP_STEPS + steps + 8)
    held = SamplingParams(
        temperature=0.0, max_tokens=free.max_tokens, grammar=GrammarSpec.of_schema(SCHEMA)
    )
    for i in range(batch):
        p, token = (held, brace) if i < num_constrained else (free, first)
        engine.add(DecodeRequest(f"r{i}", packed.shape[-2], token, p), packed)
    tokens: dict[str, list[int]] = {}
    times = []
    for step in range(WARMUP_STEPS + steps):  # the first step loads and compiles the grammar
        _sync(runner.device)
        started = time.perf_counter()
        outputs = engine.step()
        _sync(runner.device)
        if step >= WARMUP_STEPS:
            times.append((time.perf_counter() - started) * 1e3)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.chunk.token_ids)
    assert engine.scheduler.num_active == batch, "a row left the batch: the figure is off"
    free_tokens = {r: t for r, t in tokens.items() if int(r[1:]) >= num_constrained}
    return times, free_tokens


def grammar_table(lm, batch: int, steps: int, prompt_tokens: int, rounds: int = 3) -> dict:
    """The three batches in turn, `rounds` times (drift on a noisy host hits each alike);
    each figure is the median over rounds of a round's median step."""
    runner = LMRunner(lm)
    packed, first = _prompt_kv(runner, prompt_tokens)
    tokenizer = AutoTokenizer.from_pretrained(lm.checkpoint)
    [brace] = tokenizer.encode("{", add_special_tokens=False)
    shapes = (0, batch // 2, batch)
    medians: dict[int, list[float]] = {n: [] for n in shapes}
    free_by_run = {}
    for _ in range(rounds):
        for num_constrained in shapes:
            times, free = _run(runner, packed, first, brace, batch, num_constrained, steps)
            free_by_run[num_constrained] = free
            medians[num_constrained].append(statistics.median(times))
    rows = [{"constrained": n, "step_ms_p50": statistics.median(medians[n])} for n in shapes]
    base = rows[0]["step_ms_p50"]
    for row in rows:
        row["vs_free"] = round(row["step_ms_p50"] / base, 3)
        row["step_ms_p50"] = round(row["step_ms_p50"], 3)
    half = batch // 2
    same = all(free_by_run[half][r] == free_by_run[0][r] for r in free_by_run[half])
    mask_ms = _mask_ms(lm, tokenizer, brace, batch)
    return {"batch": batch, "rows": rows, "mask_ms_half": mask_ms, "free_rows_token_exact": same}


def _mask_ms(lm, tokenizer, brace: int, batch: int, repeats: int = 200) -> float:
    """The mask alone: fill the half constrained rows' bitmask and apply it to a copy of the
    batch's logits (sampling._constrain), mean ms over `repeats`."""
    from actors.engine.grammar import ModelGrammars
    from actors.engine.sampling import _constrain

    held = SamplingParams(temperature=0.0, grammar=GrammarSpec.of_schema(SCHEMA))
    grammars = ModelGrammars(lm)
    matchers = [grammars.matcher(held, [brace]) for _ in range(batch // 2)]
    logits = lm.logits(lm.embed_tokens(torch.zeros(batch, 1, dtype=torch.long))).squeeze(1)
    logits = logits.float()
    started = time.perf_counter()
    for _ in range(repeats):
        _constrain(logits, matchers + [None] * (batch - len(matchers)))
    return round((time.perf_counter() - started) / repeats * 1e3, 4)
