"""Unit tests for cluster.detokenize.IncrementalText with the tiny checkpoint's tokenizer."""

from __future__ import annotations

import random

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
