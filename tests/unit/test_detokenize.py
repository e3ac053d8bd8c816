"""Unit tests for cluster.detokenize.IncrementalText with the tiny checkpoint's tokenizer."""

from __future__ import annotations

import random
import re

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from actors.checkpoints.llava import RECIPES, build_tokenizer  # noqa: E402
from cluster.detokenize import IncrementalText  # noqa: E402

SAMPLE = "USER: What is in this image?\nASSISTANT: The image shows a person standing near a lake."


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(RECIPES["tiny-llava"])


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def char_id(tok, ch: str) -> int:
    """The id of a single-character (single-byte) token."""
    ids = encode(tok, ch)
    assert len(ids) == 1 and tok.decode(ids) == ch
    return ids[0]


def stream(detok: IncrementalText, ids: list[int], *, final: bool = True) -> list[str]:
    """Push one id at a time, then an empty final push; returns every delta."""
    deltas = [detok.push([i]) for i in ids]
    if final:
        deltas.append(detok.push([], final=True))
    return deltas


def reference_emitted(text: str, stops: tuple[str, ...]) -> str:
    """What may be shown for `text` (not final): everything before the earliest stop string;
    else all but a trailing incomplete character and the longest tail that could still
    become any one stop string."""
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        return text[: min(hits)]
    end = len(text.rstrip("\ufffd"))
    body, hold = text[:end], 0
    for s in stops:
        for k in range(min(len(s) - 1, len(body)), 0, -1):
            if body.endswith(s[:k]):
                hold = max(hold, k)
                break
    return body[: end - hold]


# ----------------------------------------------------------------------------- no stop strings


@pytest.mark.parametrize(
    "text",
    [
        SAMPLE,
        'def hello(name):\n    return f"Hello, {name}!"\n',
        "héllo 世界 ok 😀!",
        "a  b\n\n c 1234.",
    ],
)
def test_token_by_token_deltas_concatenate_to_decode(tok, text):
    ids = encode(tok, text)
    assert len(ids) > 3
    detok = IncrementalText(tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert not detok.stopped


def test_whole_push_equals_token_by_token(tok):
    ids = encode(tok, SAMPLE)
    assert IncrementalText(tok).push(ids) == SAMPLE


def test_special_tokens_are_skipped(tok):
    ids = [tok.bos_token_id] + encode(tok, "The image") + [tok.pad_token_id] + encode(tok, " shows")
    detok = IncrementalText(tok)
    out = "".join(stream(detok, ids))
    assert out == tok.decode(ids, skip_special_tokens=True) == "The image shows"


def test_hidden_ids_never_appear(tok):
    hello = encode(tok, "hello")
    hidden = hello[0]  # a normal, printable token that the caller wants hidden
    ids = hello + [tok.eos_token_id] + encode(tok, " lake") + [hidden]
    detok = IncrementalText(tok, hidden_ids=(tok.eos_token_id, hidden))
    out = "".join(stream(detok, ids))
    assert out == tok.decode(
        [i for i in ids if i not in (tok.eos_token_id, hidden)], skip_special_tokens=True
    )
    assert "</s>" not in out


def test_multibyte_characters_never_split(tok):
    text = "héllo 世界 😀 ok"
    ids = encode(tok, text)
    # the tokenizer does split these characters across ids: the test means something
    assert any("\ufffd" in tok.decode(ids[:n]) for n in range(1, len(ids)))
    detok = IncrementalText(tok)
    deltas = stream(detok, ids, final=False)
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) + detok.push([], final=True) == text
    # every prefix shown so far was a prefix of the final text
    shown = ""
    for d in deltas:
        shown += d
        assert text.startswith(shown)


# ----------------------------------------------------------------------------- stop strings


def test_multi_token_stop_string_truncates_and_stops(tok):
    text = "The image shows a person standing near a lake."
    stop = " standing near"
    ids = encode(tok, text)
    assert len(encode(tok, stop)) > 1  # spans several tokens
    detok = IncrementalText(tok, stop=(stop,))
    shown = ""
    for i in ids:
        delta = detok.push([i])
        shown += delta
        # never anything from the stop string's start onwards
        assert "standing" not in shown and text.startswith(shown)
        assert len(shown) <= text.index(stop)
    assert detok.stopped
    assert shown == "The image shows a person"
    assert detok.push([], final=True) == ""
    assert detok.push(encode(tok, " more text")) == ""


def test_stop_string_inside_one_token(tok):
    ids = encode(tok, "The image shows")
    detok = IncrementalText(tok, stop=("mag",))
    assert "".join(stream(detok, ids)) == "The i"
    assert detok.stopped


def test_earliest_of_several_stop_strings_wins(tok):
    ids = encode(tok, SAMPLE)
    detok = IncrementalText(tok, stop=("lake", "person", "shows a"))
    out = "".join(stream(detok, ids))
    assert out == SAMPLE[: SAMPLE.index("shows a")]
    assert detok.stopped


def test_stop_prefix_is_held_back_then_released(tok):
    # " stan" looks like the start of " stank" until "d" arrives
    text = "a person standing"
    ids = encode(tok, text)
    detok = IncrementalText(tok, stop=(" stank",))
    shown = ""
    for n, i in enumerate(ids, 1):
        shown += detok.push([i])
        full = tok.decode(ids[:n])
        if full.endswith((" st", " sta", " stan", " s")):
            assert shown == full[: full.rindex(" s")], "a possible stop prefix was shown"
    assert shown == text, "once it is clearly not the stop string, the held text is released"
    assert not detok.stopped


def test_held_prefix_released_on_final(tok):
    detok = IncrementalText(tok, stop=("near the",))
    ids = encode(tok, "a lake near")
    deltas = stream(detok, ids, final=False)
    assert "".join(deltas) == "a lake "
    assert detok.push([], final=True) == "near"
    assert not detok.stopped


def test_prefix_of_one_stop_does_not_hold_text_for_another(tok):
    """stops ("ab", "cX"), text "ca": "c" is no longer the start of "cX" (an "a" follows)
    and only "a" can still become "ab", so "c" must be shown."""
    c, a = char_id(tok, "c"), char_id(tok, "a")
    detok = IncrementalText(tok, stop=("ab", "cX"))
    assert detok.push([c]) == ""  # could be "cX"
    assert detok.push([a]) == "c"  # "a" could be "ab"; "c" is safe now
    assert detok.push([c]) == "a"


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_match_reference(tok, seed):
    """Random texts over a small alphabet (with multi-byte characters and stop fragments),
    pushed one token at a time: after every push the shown text is exactly what the
    reference allows, and the final text is the input truncated at the first stop."""
    rnd = random.Random(seed)
    pieces = ["a", "b", "c", "ab", "ba", " ", "é", "世", "😀", "\n", "x", "ok"]
    stops_pool = ["ab", "bc", "cab", "aac", "é世", "😀x", " b", "xx"]
    for _ in range(15):
        text = "".join(rnd.choice(pieces) for _ in range(rnd.randint(1, 14)))
        stops = tuple(rnd.sample(stops_pool, rnd.randint(0, 3)))
        ids = encode(tok, text)
        detok = IncrementalText(tok, stop=stops)
        shown = ""
        for n in range(1, len(ids) + 1):
            shown += detok.push([ids[n - 1]])
            want = reference_emitted(tok.decode(ids[:n]), stops)
            assert shown == want, (text, stops, n)
            assert "\ufffd" not in shown
        shown += detok.push([], final=True)
        hits = [text.find(s) for s in stops if s in text]
        assert shown == (text[: min(hits)] if hits else text), (text, stops)
        assert detok.stopped == bool(hits)


def test_protected_text_cannot_end_a_stop_string(tok):
    """min_tokens (vLLM): no stop string ends in the first tokens' text; the next match past
    them stops the text there."""
    text = "a lake, then a lake again"
    ids = encode(tok, text)
    detok = IncrementalText(tok, stop=("lake",))
    cut = len(encode(tok, "a lake,"))
    shown = detok.push(ids[:cut], protect=True)
    assert not detok.stopped and shown == "a lake,"[: len(shown)]
    rest = "".join(detok.push([i]) for i in ids[cut:])
    assert detok.stopped and shown + rest == text[: text.rindex("lake")]


# ------------------------------------------------- skip_special_tokens, include_stop_str_in_output


def test_special_tokens_kept_when_asked(tok):
    """skip_special_tokens=False (vLLM): the specials' own text, token by token as whole."""
    ids = [tok.bos_token_id] + encode(tok, "The image") + [tok.pad_token_id] + encode(tok, " shows")
    want = tok.decode(ids, skip_special_tokens=False)
    assert tok.bos_token in want and tok.pad_token in want
    by_token = "".join(stream(IncrementalText(tok, skip_special_tokens=False), ids))
    assert by_token == want == IncrementalText(tok, skip_special_tokens=False).push(ids)
    kept = "".join(stream(IncrementalText(tok, hidden_ids=(tok.eos_token_id,)), ids))
    assert kept == "The image shows", "the default still skips them"


def test_hidden_stop_token_stays_out_with_specials_shown(tok):
    ids = encode(tok, "a lake") + [tok.eos_token_id]
    detok = IncrementalText(tok, hidden_ids=(tok.eos_token_id,), skip_special_tokens=False)
    assert "".join(stream(detok, ids)) == "a lake"
    shown = IncrementalText(tok, skip_special_tokens=False)
    assert "".join(stream(shown, ids)) == "a lake" + tok.eos_token


def test_included_stop_string_ends_the_text(tok):
    text = "The image shows a person standing near a lake."
    ids = encode(tok, text)
    detok = IncrementalText(tok, stop=(" standing",), include_stop=True)
    shown = "".join(stream(detok, ids))
    assert detok.stopped and shown == "The image shows a person standing"
    assert detok.push(encode(tok, " more")) == ""


def test_included_stop_holds_nothing_back(tok):
    """Text that may still become the stop string is shown at once: it stays either way."""
    ids = encode(tok, "a lake near")
    held = IncrementalText(tok, stop=(" near the",))
    shown = IncrementalText(tok, stop=(" near the",), include_stop=True)
    assert "".join(stream(held, ids, final=False)) == "a lake"
    assert "".join(stream(shown, ids, final=False)) == "a lake near"


def test_included_stop_ends_where_the_first_stop_completes(tok):
    """ "son" completes inside "person standing" before that string does: the text ends
    after "son", whether the ids come one by one or all at once."""
    ids = encode(tok, "a person standing near")
    stops = ("person standing", "son")
    included = IncrementalText(tok, stop=stops, include_stop=True)
    assert "".join(stream(included, ids)) == "a person"
    whole = IncrementalText(tok, stop=stops, include_stop=True)
    assert whole.push(ids) == "a person" and whole.stopped


def test_included_stop_after_protected_text(tok):
    text = "a lake, then a lake again"
    ids = encode(tok, text)
    cut = len(encode(tok, "a lake,"))
    detok = IncrementalText(tok, stop=("lake",), include_stop=True)
    shown = detok.push(ids[:cut], protect=True)
    shown += "".join(detok.push([i]) for i in ids[cut:])
    assert detok.stopped and shown == "a lake, then a lake"


# ------------------------------------------------------------------------- a window, not all ids
# IncrementalText decodes a few ids per push (issue #24); its text must be what decoding all
# ids gives. FullDecode is the implementation before it, decoding all ids at every push: the
# oracle, push by push (deltas and `stopped`), with every tokenizer kind built here.


class FullDecode:
    """IncrementalText as it was: decode all ids at every push, search the whole text."""

    def __init__(
        self,
        tokenizer,
        stop: tuple[str, ...] = (),
        hidden_ids: tuple[int, ...] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        self._tokenizer, self._stop, self._hidden = tokenizer, stop, set(hidden_ids)
        self._skip, self._include = skip_special_tokens, include_stop
        self._ids: list[int] = []
        self._emitted = self._stop_after = 0
        self.stopped = False

    def push(self, token_ids, final: bool = False, protect: bool = False) -> str:
        self._ids.extend(t for t in token_ids if t not in self._hidden)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if protect:
            self._stop_after = len(text)
        safe = len(text)
        for stop in self._stop:
            at = text.find(stop, max(0, self._stop_after - len(stop) + 1))
            if at != -1:  # included: the text ends where the first stop string completes
                safe, self.stopped = min(safe, at + len(stop) if self._include else at), True
        if not self.stopped and not final:
            safe = min(safe, self._held_back(text))
        delta = text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return delta

    def _held_back(self, text: str) -> int:
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        body, hold = text[:end], 0
        for stop in () if self._include else self._stop:
            for k in range(min(len(stop) - 1, end), 0, -1):
                if body.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return end - hold


_SP_CORPUS = [
    SAMPLE,
    "A café near the lake: a person with a small dog, a red boat and two trees.",
    'def hello(name):\n    return f"Hello, {name}!"\n',
] * 20
_SP_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def sentencepiece_like():
    """A Llama-2-style tokenizer: "▁" for spaces, byte-fallback tokens <0xNN> for characters
    not in its (small) vocabulary, and a decoder that strips the leading space of what it
    decodes: a window starting mid-text loses that space. Built here: no checkpoint has one."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def words(tok):
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="never", split=True)
        return tok

    trained = words(Tokenizer(models.BPE(unk_token="<unk>")))
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=_SP_SPECIALS, show_progress=False)
    trained.train_from_iterator(_SP_CORPUS, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = words(Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(_SP_SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def qwen_tok():
    from actors.checkpoints.qwen import QWEN_RECIPES
    from actors.checkpoints.qwen import build_tokenizer as build_qwen_tokenizer

    return build_qwen_tokenizer(QWEN_RECIPES["tiny-qwen2-audio"])


@pytest.fixture(scope="module")
def sp_tok():
    return sentencepiece_like()


KINDS = {"llava-bpe": "tok", "qwen2-bpe": "qwen_tok", "llama-sp": "sp_tok"}
BYTE_LEVEL = ("llava-bpe", "qwen2-bpe")


@pytest.fixture(params=list(KINDS))
def kind(request):
    return request.param, request.getfixturevalue(KINDS[request.param])


def byte_id(tok, b: int) -> int:
    return tok.convert_tokens_to_ids(f"<0x{b:02X}>")


def is_byte(tok, i: int) -> bool:
    """A byte-fallback token <0xNN>."""
    return tok.convert_ids_to_tokens(i).startswith("<0x")


def compare(tok, stops, hidden, schedule, *, past_stop: bool = True, **options) -> str:
    """Push `schedule` ((ids, protect, final) per push) through both; every delta and
    `stopped` must agree. Returns the text shown. `past_stop`: go on pushing after a stop
    string (nothing holds "\ufffd" back then: see test_random_texts_match_full_decode).
    `options`: skip_special_tokens, include_stop, given to both."""
    new = IncrementalText(tok, stops, hidden, **options)
    old = FullDecode(tok, stops, hidden, **options)
    shown = ""
    for n, (ids, protect, final) in enumerate(schedule):
        if old.stopped and not past_stop:
            break
        got, want = new.push(ids, final, protect), old.push(ids, final, protect)
        assert (got, new.stopped) == (want, old.stopped), (n, stops, schedule[: n + 1])
        shown += got
    return shown


def random_schedule(rnd, ids, *, boundary=lambda n: True, max_chunk=4, p_protect=0.2):
    """Pushes of 0 to max_chunk ids; protect at random (and min_tokens-like, on the first
    pushes), a final push at random and at the end, all only where `boundary(ids pushed)`;
    ids keep coming after a stop or a final push (the caller stops reading, not this)."""
    schedule, pos, protect_first = [], 0, rnd.randint(0, 5)
    while pos < len(ids):
        chunk = ids[pos : pos + rnd.randint(0, max_chunk)]
        pos += len(chunk)
        ok = boundary(pos)
        protect = ok and (len(schedule) < protect_first or rnd.random() < p_protect)
        final = ok and (pos == len(ids) or rnd.random() < 0.05)
        schedule.append((chunk, protect, final))
    return schedule


def random_stops(rnd, text: str, pool=("ab", "e ", " t", "x", "\n")) -> tuple[str, ...]:
    """Substrings of `text` (across token boundaries, some more than once) and a few others."""
    cuts = [rnd.randrange(len(text)) for _ in range(rnd.randint(0, 3))] if text else []
    found = tuple(text[a : a + rnd.randint(1, 6)] for a in cuts)
    return found + tuple(rnd.sample(pool, rnd.randint(0, 2)))


@pytest.mark.parametrize("name", BYTE_LEVEL)
@pytest.mark.parametrize("seed", range(4))
def test_random_ids_match_full_decode_byte_level(name, seed, request):
    """Any ids at all (specials, half characters, invalid UTF-8, hidden ids), any pushes,
    stop strings with "\ufffd" in them: a byte-level decoder is UTF-8's, which resynchronises
    after a complete character, so the windows give exactly the whole decode."""
    tok = request.getfixturevalue(KINDS[name])
    rnd = random.Random(seed)
    for _ in range(60):
        ids = [rnd.randrange(len(tok)) for _ in range(rnd.randint(1, 40))]
        stops = random_stops(rnd, tok.decode(ids, skip_special_tokens=True), ("\ufffd", "ab"))
        hidden = (tok.eos_token_id, *rnd.sample(range(len(tok)), 2))
        compare(tok, stops, hidden, random_schedule(rnd, ids))


@pytest.mark.parametrize("name", BYTE_LEVEL)
@pytest.mark.parametrize("skip,include", [(False, False), (True, True), (False, True)])
def test_random_ids_match_full_decode_with_options(name, skip, include, request):
    """As above, with special tokens kept in the text and/or stop strings kept in it."""
    tok = request.getfixturevalue(KINDS[name])
    rnd = random.Random(hash((name, skip, include)) % 1000)
    specials = tok.all_special_ids
    for _ in range(40):
        ids = [rnd.randrange(len(tok)) for _ in range(rnd.randint(1, 30))]
        for _ in range(rnd.randint(0, 3)):
            ids.insert(rnd.randrange(len(ids) + 1), rnd.choice(specials))
        text = tok.decode(ids, skip_special_tokens=skip)
        stops = random_stops(rnd, text, ("ab", "</s>", "\ufffd"))
        hidden = (tok.eos_token_id,) if rnd.random() < 0.5 else ()
        schedule = random_schedule(rnd, ids)
        compare(tok, stops, hidden, schedule, skip_special_tokens=skip, include_stop=include)


def test_random_texts_with_options_sentencepiece(sp_tok):
    """Specials between words and stops kept in the text, on the decoder that strips a
    leading space (whole characters only, as test_random_texts_match_full_decode)."""
    tok, rnd = sp_tok, random.Random(5)
    words = [" the", " lake", "a", " 世界", "😀", "\n", " ok"]
    for _ in range(40):
        ids = encode(tok, "".join(rnd.choice(words) for _ in range(rnd.randint(1, 10))))
        for _ in range(rnd.randint(0, 2)):
            ids.insert(rnd.randrange(len(ids) + 1), rnd.choice(tok.all_special_ids))
        text = tok.decode(ids, skip_special_tokens=False)
        ok = {n for n in range(len(ids) + 1) if "\ufffd" not in tok.decode(ids[:n])}
        schedule = random_schedule(rnd, ids, boundary=ok.__contains__)
        stops = random_stops(rnd, text, (" l", "</s>", "a "))
        for skip, include in ((False, False), (False, True), (True, True)):
            compare(
                tok,
                stops,
                (),
                schedule,
                past_stop=False,
                skip_special_tokens=skip,
                include_stop=include,
            )


def test_random_ids_match_full_decode_sentencepiece(sp_tok):
    """Random ids where every run of byte-fallback tokens spells whole characters (see
    test_byte_fallback_run_that_turns_invalid for one that does not)."""
    tok, rnd = sp_tok, random.Random(7)
    plain = [i for i in range(len(tok)) if not is_byte(tok, i)]
    chars = ["a", "é", "世", "界", "😀", "€", "\n", "Ω"]
    for _ in range(150):
        ids, boundaries = [], {0}
        for _ in range(rnd.randint(1, 14)):
            if rnd.random() < 0.4:
                ids += [byte_id(tok, b) for b in rnd.choice(chars).encode()]
            else:
                ids.append(rnd.choice(plain))
            boundaries.add(len(ids))
        stops = random_stops(rnd, tok.decode(ids, skip_special_tokens=True))
        hidden = (tok.eos_token_id, rnd.choice(plain))
        schedule = random_schedule(rnd, ids, boundary=boundaries.__contains__)
        compare(tok, stops, hidden, schedule, past_stop=False)


@pytest.mark.parametrize("seed", range(3))
def test_random_texts_match_full_decode(kind, seed):
    """Texts with emoji and CJK split across tokens, stop strings across token boundaries,
    hidden ids, min_tokens-like protect, final pushes, several ids a push. Protect and final
    come only between whole characters: a byte-fallback decoder decodes a run of byte tokens
    as a whole, so a character that begins a run changes the text already decoded before it
    (decoding all ids only differs from the windows in how many "\ufffd" an unfinished run
    has, which only protect and final can see)."""
    name, tok = kind
    rnd = random.Random(seed)
    pieces = ["a", "b", "ab", " the", " lake", "é", "世", "界", "😀", "🙂", "\n", "  ", ".", "x"]
    stop_pool = ("ab", " l", "世界", "😀x", "e\n", "a.", "界 ")
    for _ in range(25):
        text = "".join(rnd.choice(pieces) for _ in range(rnd.randint(1, 20)))
        ids = encode(tok, text)
        if rnd.random() < 0.3:
            ids.insert(rnd.randrange(len(ids) + 1), tok.eos_token_id)
        stops = random_stops(rnd, text, stop_pool)
        hidden = (rnd.choice(ids),) if rnd.random() < 0.3 else ()
        if name not in BYTE_LEVEL and any(is_byte(tok, i) for i in hidden):
            hidden = ()  # a byte-fallback run with a byte taken out is invalid UTF-8
        kept = [i for i in ids if i not in hidden]
        whole = [tok.decode(kept[:n], skip_special_tokens=True) for n in range(len(ids) + 1)]
        visible = [sum(i not in hidden for i in ids[:n]) for n in range(len(ids) + 1)]
        schedule = random_schedule(
            rnd,
            ids,
            boundary=lambda n, w=whole, v=visible: "\ufffd" not in w[v[n]],
            max_chunk=rnd.choice((1, 3)),
        )
        compare(tok, stops, hidden, schedule, past_stop=name in BYTE_LEVEL)


def test_long_stream_matches_full_decode(kind):
    """1,000 tokens: the settled text is set aside behind the searched tail; stop strings
    that match late, early, or never, protect now and then, and pushes that go on past the
    stop (a later protect lets text past the stop through, in the oracle too)."""
    name, tok = kind
    rnd = random.Random(11)
    words = [" the", " lake", " person", " 世界", " 😀", " é", "\n", ",", " boat", " ok"]
    ids = encode(tok, "".join(rnd.choice(words) for _ in range(1000)))[:1000]
    full = tok.decode(ids)
    ok = lambda n: True
    if name not in BYTE_LEVEL:
        ok = {n for n in range(len(ids) + 1) if "\ufffd" not in tok.decode(ids[:n])}.__contains__
    for stops in [(), (" 世界 😀 lake",), (full[-40:-25], " ok ok ok ok"), ("e",)]:
        schedule = random_schedule(rnd, ids, boundary=ok, p_protect=0.02)
        compare(tok, stops, (tok.eos_token_id,), schedule, past_stop=name in BYTE_LEVEL)


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_protect_long_after_a_stop(name, request):
    """A stop string early, then hundreds of tokens more, then a protect push: no stop
    string may end before it now, so (as before) the text from the stop on comes through,
    set aside behind the searched tail long ago (and nothing is held back after a stop)."""
    tok = request.getfixturevalue(KINDS[name])
    ids = encode(tok, "a lake, then " + " a person near the 世界 😀 boat" * 60)
    schedule = [([i], False, False) for i in ids[:-50]] + [([], True, False)]
    schedule += [([i], False, False) for i in ids[-50:]] + [([], False, True)]
    shown = compare(tok, ("lake",), (), schedule)
    assert shown.startswith(tok.decode(ids[:-50]))  # "a ", then all the text at the protect


def test_window_keeps_a_leading_space_sentencepiece(sp_tok):
    """Decoding "▁world" alone gives "world": the window's context keeps the space."""
    tok, text = sp_tok, "The lake  and a boat"
    ids = encode(tok, text)
    assert tok.decode(ids) == text and tok.decode(ids[1:]) == text[len("The ") :]
    assert "".join(stream(IncrementalText(tok), ids)) == text
    detok = IncrementalText(tok)
    assert "".join(detok.push(ids[n : n + 3]) for n in range(0, len(ids), 3)) == text


def test_byte_fallback_run_that_turns_invalid(sp_tok):
    """A byte-fallback decoder turns every byte of an invalid run into "\ufffd", even the
    bytes of characters shown before the run went bad: decoding all ids gives "The" and five
    "\ufffd" here, after "The世A" was shown. Neither implementation retracts shown text; the
    old one then showed the difference in length as "\ufffd", the window shows how many
    bytes of the run it holds as "\ufffd" (vLLM and TGI do the same). Those counts may
    differ: the one case found where the window's text is not the old one."""
    tok = sp_tok
    ids = encode(tok, "The") + [byte_id(tok, b) for b in "世A".encode() + b"\xe4"]
    assert tok.decode(ids) == "The" + "\ufffd" * 5
    assert "".join(stream(FullDecode(tok), ids)) == "The世A" + "\ufffd" * 3
    assert re.fullmatch("The世A\ufffd+", "".join(stream(IncrementalText(tok), ids)))


class CountingTokenizer:
    """Wraps a tokenizer: counts the ids passed to decode."""

    def __init__(self, tok):
        self.tok, self.calls, self.ids, self.widest = tok, 0, 0, 0

    def decode(self, ids, **kwargs):
        self.calls += 1
        self.ids += len(ids)
        self.widest = max(self.widest, len(ids))
        return self.tok.decode(ids, **kwargs)


def test_decode_cost_is_flat(kind):
    """At 1,000 tokens pushed one at a time, a push decodes a few ids (before: all of them)."""
    name, tok = kind
    rnd = random.Random(3)
    words = [" the", " lake", " 世界", " 😀", " é", "\n", " boat", "x"]
    ids = encode(tok, "".join(rnd.choice(words) for _ in range(1000)))[:1000]
    assert len(ids) == 1000
    new, old = CountingTokenizer(tok), CountingTokenizer(tok)
    new_text, old_text = IncrementalText(new, ("never there",)), FullDecode(old, ("never there",))
    assert "".join(new_text.push([i]) for i in ids) == "".join(old_text.push([i]) for i in ids)
    assert new.ids / len(ids) < 16 and new.widest <= 16 and new.calls <= 2 * len(ids)
    assert old.ids / len(ids) > 400  # the whole stream so far, every push


def test_the_rust_decoder_serves_where_transformers_adds_nothing(tok):
    """The fast path decodes exactly as `tok.decode`; a tokenizer that cleans up spaces keeps
    transformers' own decode (the clean-up is not in the Rust decoder)."""
    from cluster.tokenizer_calls import plain_decode

    ids = encode(tok, SAMPLE)
    assert plain_decode(tok) == tok._tokenizer.decode
    for skip in (True, False):
        assert plain_decode(tok)(ids, skip_special_tokens=skip) == tok.decode(
            ids, skip_special_tokens=skip
        )
    before, tok.clean_up_tokenization_spaces = tok.clean_up_tokenization_spaces, True
    try:
        assert plain_decode(tok) == tok.decode
    finally:
        tok.clean_up_tokenization_spaces = before
