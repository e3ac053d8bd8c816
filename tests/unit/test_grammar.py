"""Constrained decoding (actors/engine/grammar.py) through the real engines on the tiny
random-weight checkpoint: output that parses and validates, free rows untouched beside
constrained ones, resumed requests, compile errors and the cache, one device read a step."""

from __future__ import annotations

import json
import pickle

import pytest

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from transformers import AutoTokenizer  # noqa: E402

from actors.engine import grammar  # noqa: E402
from actors.engine.decode import DecodeEngine  # noqa: E402
from actors.engine.grammar import GrammarError, Grammars, grammar_of  # noqa: E402
from actors.engine.host_syncs import counting_syncs  # noqa: E402
from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.engine.prefill import PrefillEngine  # noqa: E402
from actors.engine.sampling import sample_rows  # noqa: E402
from actors.models.adapter import Part, load_adapter  # noqa: E402
from actors.types import (  # noqa: E402
    DecodeRequest,
    FinishReason,
    GrammarKind,
    GrammarSpec,
    PrefillRequest,
    SamplingParams,
    TokenHistory,
)
from router.worker_settings import DecodeSettings, PrefillSettings  # noqa: E402

EOS = 1  # the tiny tokenizer's </s>
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "boolean"},
        "c": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
SPEC = GrammarSpec.of_schema(SCHEMA)
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=1.0, top_k=50)


@pytest.fixture(scope="module")
def runner(ckpt):
    return LMRunner(load_adapter(ckpt, part=Part.LANGUAGE_MODEL, dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def grammars(tokenizer, runner):
    probe = runner.adapter.logits(runner.adapter.embed_tokens(torch.zeros(1, 1, dtype=torch.long)))
    return Grammars(tokenizer, probe.shape[-1], [EOS])


def params(spec=SPEC, seed=0, max_tokens=96, stop=(EOS,), **kind) -> SamplingParams:
    return SamplingParams(
        seed=seed, max_tokens=max_tokens, stop_token_ids=stop, grammar=spec, **(kind or GREEDY)
    )


def prompt(i: int) -> tuple[int, ...]:
    return tuple(range(10 + i, 20 + 3 * i))


def serve(runner, requests: dict[str, tuple]) -> dict[str, tuple[list[int], FinishReason]]:
    """Each request (prompt, params, generated before: a resumed one) through the prefill
    engine, then one decode batch; its tokens from this attempt and how it finished."""
    prefill = PrefillEngine(runner, PrefillSettings(max_chunk_tokens=512))
    decode = DecodeEngine(runner, DecodeSettings(max_batch_size=8), max_model_len=1024)
    for name, (ids, p, *before) in requests.items():
        done = tuple(before[0]) if before else ()
        prefill.add(PrefillRequest(name, ids + done, (), p, num_output_tokens=len(done)))
    out: dict[str, tuple[list[int], FinishReason | None]] = {}
    while prefill.has_work:
        for o in prefill.step():
            ids, p, *before = requests[o.request_id]
            done = tuple(before[0]) if before else ()
            assert o.error is None and o.first is not None, o.error
            history = TokenHistory(ids, done) if p.needs_history else TokenHistory()
            n, first = len(ids) + len(done), o.first.token_id
            decode.add(DecodeRequest(o.request_id, n, first, p, o.rope_delta, history), o.packed_kv)
            out[o.request_id] = ([o.first.token_id], None)
    while decode.has_work:
        for o in decode.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + list(o.chunk.token_ids), o.chunk.finish_reason)
    assert decode.batch.num_rows == 0
    return out


def text(tokenizer, tokens: list[int]) -> str:
    """The output as the ingress detokenizes it (special tokens skipped), stop token aside."""
    return tokenizer.decode([t for t in tokens if t != EOS], skip_special_tokens=True)


def json_prefix(tokenizer, text: str) -> bool:
    """Whether `text` begins some JSON text, by xgrammar's builtin JSON grammar (another
    grammar than the one that produced it)."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_builtin_json_grammar()
    return xgr.GrammarMatcher(compiled).accept_string(text)


@pytest.mark.parametrize("kind", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_constrained_output_parses_and_validates(runner, tokenizer, kind):
    requests = {f"s{i}": (prompt(i), params(seed=i, **kind)) for i in range(3)}
    for name, (tokens, reason) in serve(runner, requests).items():
        assert reason == FinishReason.STOP and tokens[-1] == EOS, (name, tokens)
        jsonschema.validate(json.loads(text(tokenizer, tokens)), SCHEMA)


@pytest.mark.parametrize("kind", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_json_object_is_one_or_its_beginning_at_max_tokens(runner, tokenizer, kind):
    """Random weights wander inside an open object: bounded by max_tokens, the output is a
    JSON object's beginning; finished by a stop token, a whole object."""
    spec = GrammarSpec(GrammarKind.JSON_OBJECT)
    requests = {f"o{i}": (prompt(i), params(spec, seed=i, max_tokens=48, **kind)) for i in range(4)}
    reasons = set()
    for name, (tokens, reason) in serve(runner, requests).items():
        reasons.add(reason)
        out = text(tokenizer, tokens)
        assert out.startswith("{") and json_prefix(tokenizer, out), (name, out)
        if reason == FinishReason.STOP:
            assert isinstance(json.loads(out), dict)
        else:
            assert reason == FinishReason.LENGTH and len(tokens) == 48
    assert FinishReason.STOP in reasons  # the test sees a whole object


@pytest.mark.parametrize("kind", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_free_rows_beside_constrained_rows_are_token_identical(runner, kind):
    free = {
        f"f{i}": (prompt(i), params(None, seed=i, max_tokens=24, stop=(), **kind)) for i in (0, 1)
    }
    alone = serve(runner, free)
    beside = serve(
        runner, {**free, **{f"g{i}": (prompt(i + 2), params(seed=i, **kind)) for i in (0, 1)}}
    )
    assert {name: beside[name] for name in free} == alone


def test_free_rows_are_bit_identical_in_the_sampler(grammars):
    """Same logits: a free row's token and logprobs do not see its constrained neighbours."""
    x = torch.randn(6, grammars.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
    ps = [SamplingParams(seed=i, num_logprobs=3, **(GREEDY if i % 2 else SEEDED)) for i in range(6)]
    plain = sample_rows(x.clone(), ps, list(range(6)))
    matchers = [grammars.matcher(SPEC) if i in (1, 4) else None for i in range(6)]
    mixed = sample_rows(x.clone(), ps, list(range(6)), matchers=matchers)
    assert [mixed[i] for i in (0, 2, 3, 5)] == [plain[i] for i in (0, 2, 3, 5)]
    for i in (1, 4):  # "{" (all the schema allows first), logprobs of the unmasked model
        assert grammars.matcher(SPEC).accept_token(mixed[i].token_id)
        assert (
            mixed[i].token_id != plain[i].token_id and mixed[i].logprob.top == plain[i].logprob.top
        )
        want = torch.log_softmax(x[i], -1)[mixed[i].token_id].item()
        assert mixed[i].logprob.logprob == pytest.approx(want, abs=1e-6)


def test_a_resumed_request_continues_as_if_never_interrupted(runner):
    whole, _ = serve(runner, {"r": (prompt(1), params())})["r"]
    assert whole[-1] == EOS and len(whole) > 8
    for k in (1, 5, len(whole) - 2):  # after the first token, mid-way, just before the end
        p = params(max_tokens=96 - k)
        again, reason = serve(runner, {"r": (prompt(1), p, whole[:k])})["r"]
        assert whole[:k] + again == whole and reason == FinishReason.STOP


def test_a_replayed_matcher_continues_as_one_that_accepted_step_by_step(grammars):
    gen = torch.Generator().manual_seed(1)
    stepwise, tokens = grammars.matcher(SPEC), []
    p = SamplingParams(seed=4, stop_token_ids=(EOS,), **SEEDED)
    while not stepwise.is_terminated() and len(tokens) < 80:
        x = torch.randn(1, grammars.vocab_size, generator=gen) * 3
        replayed = grammars.matcher(SPEC, tokens, [EOS])
        masks = [
            grammar.row_bitmask([m], grammars.vocab_size)[1].clone() for m in (stepwise, replayed)
        ]
        assert torch.equal(*masks)
        (a,) = sample_rows(x, [p], [len(tokens)], matchers=[stepwise])
        (b,) = sample_rows(x, [p], [len(tokens)], matchers=[replayed])
        assert a == b and a is not None
        tokens.append(a.token_id)
    assert tokens[-1] == EOS and stepwise.is_terminated()


def test_a_complete_grammar_allows_only_the_request_stop_tokens(grammars, tokenizer):
    m = grammars.matcher(SPEC, stop_token_ids=[7, 9])
    ids = tokenizer.encode('{"a": 1, "b": true, "c": "ab"}', add_special_tokens=False)
    assert all(m.accept_token(t) for t in ids)
    rows, bitmask = grammar.row_bitmask([m], grammars.vocab_size)
    allowed = [t for t in range(grammars.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert allowed == [7, 9] and m.accept_token(9) and m.is_terminated()
    x = torch.zeros(1, grammars.vocab_size)  # a terminated matcher allows nothing: the row fails
    assert sample_rows(x, [SamplingParams(**GREEDY)], [0], matchers=[m]) == [None]


def test_without_stop_tokens_a_finished_grammar_ends_the_request(runner):
    """ignore_eos (no stop ids): the grammar ends on the tokenizer's EOS, and so does decode."""
    tokens, reason = serve(runner, {"r": (prompt(0), params(stop=()))})["r"]
    assert reason == FinishReason.STOP and tokens[-1] == EOS


@pytest.mark.parametrize(
    "schema, problem",
    [
        ('{"type": "objec"}', 'Unsupported type "objec"'),
        ("{not json", "Failed to parse JSON"),
        ('{"type": "integer", "minimum": 5, "maximum": 1}', "minimum greater than maximum"),
        ('{"$ref": "#/nowhere"}', "nowhere"),
    ],
)
def test_an_invalid_schema_names_the_problem(grammars, schema, problem):
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, schema)
    for compile_it in (grammar_of, grammars.compile):
        with pytest.raises(GrammarError, match="invalid JSON schema") as err:
            compile_it(spec)
        assert problem in str(err.value) and "/project/" not in str(err.value)


def test_an_invalid_grammar_fails_its_request_alone(runner):
    bad = params(GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "objec"}'))
    prefill = PrefillEngine(runner, PrefillSettings(max_chunk_tokens=512))
    prefill.add(PrefillRequest("bad", prompt(0), (), bad))
    prefill.add(PrefillRequest("good", prompt(1), (), params()))
    outs = {o.request_id: o for o in prefill.step()}
    assert "objec" in outs["bad"].error and outs["good"].error is None
    decode = DecodeEngine(runner, DecodeSettings(max_batch_size=4), max_model_len=1024)
    good, n = outs["good"], len(prompt(1))
    decode.add(DecodeRequest("bad", n, 97, bad), good.packed_kv.clone())
    decode.add(DecodeRequest("good", n, good.first.token_id, params()), good.packed_kv)
    first = {o.request_id: o.chunk for o in decode.step()}
    assert first["bad"].finish_reason == FinishReason.ERROR and first["good"].finish_reason is None


def test_the_compile_cache_compiles_a_spec_once(tokenizer, grammars):
    local = Grammars(tokenizer, grammars.vocab_size, [EOS], cache_size=2)
    twin = GrammarSpec.of_schema(json.loads(json.dumps(SCHEMA)))  # equal, built apart
    assert twin == SPEC and twin.key == SPEC.key and len(SPEC.key) == 16
    assert local.compile(SPEC) is local.compile(twin) and (local.misses, local.hits) == (1, 1)
    local.matcher(SPEC)
    assert (local.misses, local.hits) == (1, 2)
    for schema in ({"type": "boolean"}, {"type": "null"}):  # evicts SPEC (least recently used)
        local.compile(GrammarSpec.of_schema(schema))
    local.compile(SPEC)
    assert local.misses == 4


def test_specs_keep_the_schema_order_and_cross_processes():
    spec = GrammarSpec.of_schema({"z": 1, "a": 2})
    assert spec.schema == '{"z":1,"a":2}'  # property order is the output's order
    assert GrammarSpec.of_schema({"a": 2, "z": 1}).key != spec.key
    p = SamplingParams(grammar=spec)
    assert pickle.loads(pickle.dumps(p)) == p and p.needs_history


def test_a_step_with_constrained_rows_reads_the_device_once(runner):
    engine = DecodeEngine(runner, DecodeSettings(max_batch_size=8), max_model_len=1024)
    for i, p in enumerate(
        [params(), params(None, max_tokens=12, stop=()), params(seed=3, **SEEDED)]
    ):
        first, packed, _ = runner.prefill(prompt(i), (), [], params(None, **GREEDY))
        engine.add(
            DecodeRequest(f"r{i}", len(prompt(i)), 97 if p.grammar else first.token_id, p), packed
        )
    counts = []
    while engine.has_work:
        with counting_syncs() as c:
            engine.step()
        counts.append(sum(c.values()))
    assert len(counts) > 12 and max(counts) == 1, counts


def test_a_batch_without_grammars_makes_no_grammar_call(runner, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a grammar call for a free batch")

    for name in ("row_bitmask", "advance", "apply_bitmask"):
        monkeypatch.setattr(grammar, name, refuse)
    out = serve(runner, {"f": (prompt(0), params(None, max_tokens=6, stop=()))})
    assert len(out["f"][0]) == 6
