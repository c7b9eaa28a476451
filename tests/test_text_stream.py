"""Streamed text without the server: multi-byte characters split across byte tokens, stop
strings across token boundaries, and the offline engine's text matching what a stream joins to."""
from __future__ import annotations

import pytest

from bullet_trt.model.corpus_tokenizer import write_corpus_tokenizer
from bullet_trt.model.tokenizer import IncrementalDetokenizer, Tokenizer
from bullet_trt.serving.stop_strings import StopStrings
from bullet_trt.serving.text_stream import TextStream


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(write_corpus_tokenizer(tmp_path_factory.mktemp("tok")))


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: the byte-level alphabet's single-byte tokens, so every
    multi-byte character is split across tokens whatever the merges would have done."""
    table = _bytes_to_unicode()
    ids = [tok._tok.token_to_id(table[b]) for b in text.encode("utf-8")]
    assert None not in ids
    return ids


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others
    # for the characters from U+0100 on, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def one_by_one(stream: TextStream, ids: list[int]) -> list[str]:
    pieces = []
    for i in ids:
        pieces.append(stream.push(i))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces


@pytest.mark.parametrize("text", ["😀", "東京", "a😀b", "€ and 👨‍👩‍👧", "서울"])
def test_a_character_split_across_byte_tokens_comes_out_whole(tok, text):
    ids = byte_ids(tok, text)
    assert len(ids) == len(text.encode())
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # alone, a byte is no character
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # the emoji's four bytes: nothing until the last one completes it
    if text == "😀":
        assert pieces == ["", "", "", "😀", ""]


def test_a_byte_that_never_completes_is_replaced_as_the_full_decode_replaces_it(tok):
    ids = byte_ids(tok, "a") + byte_ids(tok, "😀")[:2] + byte_ids(tok, "b")
    full = tok.decode(ids)
    assert "\ufffd" in full
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == full
    assert sum(p.count("\ufffd") for p in pieces) == full.count("\ufffd")
    # a truncated character at the very end is held until the output ends, then replaced
    detok = IncrementalDetokenizer(tok)
    cut = byte_ids(tok, "x😀")[:3]
    assert [detok.step([i]) for i in cut] == ["x", "", ""] and detok.flush() == tok.decode(cut)[1:]


def test_stop_strings_held_back_then_cut():
    s = StopStrings(["lo w", "END"])
    assert s.feed("hel") == "he" and s.held == "l"  # may begin "lo w"
    assert s.feed("lo") == "l" and s.held == "lo"
    assert s.feed(" ") == "" and s.held == "lo "
    assert s.feed("wor") == "" and s.stopped  # found: nothing of it is sent
    assert s.feed("more") == "" and s.flush() == ""
    s = StopStrings(["lo w"])
    assert s.feed("lo") == "" and s.feed("l!") == "lol!"  # it was none: released
    assert s.feed("EN") == "EN" and s.flush() == ""
    s = StopStrings(["ab"])
    assert s.feed("xa") == "x" and s.flush() == "a"  # output ended: the held tail is text


def test_stop_string_across_token_boundaries_ends_the_stream_at_the_token_that_completes_it(tok):
    text = "hello world, again"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "lo wo"
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds it
    assert tok.stop_sequences([stop])[0] != ids[1:3]  # nor do its own token ids appear
    stream = TextStream(tok, [stop])
    pieces = one_by_one(stream, ids)
    assert stream.stopped and "".join(pieces) == "hel"
    end = text.index(stop) + len(stop)
    # it stopped at the first token whose text reaches the end of the stop string
    assert len(tok.decode(ids[:stream.num_tokens])) >= end > len(tok.decode(ids[:stream.num_tokens - 1]))
    assert not any("lo" in p for p in pieces)


def test_tokens_given_together_stop_where_one_at_a_time_stop(tok):
    """The reader merges the outputs of several engine steps; the stop lands on the same token."""
    ids = tok.encode("hello world, again and again", add_special_tokens=False)
    single = TextStream(tok, ["d, a"])
    one = "".join(one_by_one(single, ids))
    merged = TextStream(tok, ["d, a"])
    together = merged.extend(ids[:3]) + merged.extend(ids[3:]) + merged.finish()
    assert together == one == "hello worl" and merged.num_tokens == single.num_tokens < len(ids)
    plain = TextStream(tok, [])  # no stop strings: one decode for the lot
    assert plain.extend(ids) + plain.finish() == tok.decode(ids) and plain.num_tokens == len(ids)


def test_stop_string_split_inside_a_multibyte_character(tok):
    ids = byte_ids(tok, "ok 東京 then")
    stream = TextStream(tok, ["京 t"])
    pieces = one_by_one(stream, ids)
    assert "".join(pieces) == "ok 東" and stream.stopped
    assert not any("\ufffd" in p for p in pieces)


def test_no_stop_means_the_full_decode_and_min_tokens_delays_the_search(tok):
    text = "stop here, stop there"
    ids = tok.encode(text, add_special_tokens=False)
    plain = TextStream(tok, [])
    assert "".join(one_by_one(plain, ids)) == text and not plain.stopped
    early = TextStream(tok, ["stop"], min_tokens=len(tok.encode("stop here,", add_special_tokens=False)) + 1)
    out = "".join(one_by_one(early, ids))
    assert out == "stop here, " and early.stopped  # the first "stop" came before min_tokens


def test_offline_engine_cuts_stop_strings_like_the_stream(tmp_path_factory):
    """LLM.generate returns the text a stream of the same request joins to: a stop string
    found in the text ends it, whatever tokens wrote it, at the token that completed it."""
    from bullet_trt import LLM, SamplingParams
    from tests.tiny_engine import tiny_engine

    with LLM(str(tiny_engine(tmp_path_factory.mktemp("tiny") / "engine"))) as llm:
        prompt = "The quick brown fox"
        full = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
        tok = llm.tokenizer
        # a stop string from the middle of one token to the middle of the next
        stop = next(tok.decode([a])[-2:] + tok.decode([b])[:2]
                    for a, b in zip(full.token_ids[2:], full.token_ids[3:])
                    if len(tok.decode([a]).strip()) >= 2 and len(tok.decode([b]).strip()) >= 2
                    and tok.decode([a]).isascii() and tok.decode([b]).isascii())
        assert tok.stop_sequences([stop])[0] not in [full.token_ids[i:i + 2] for i in range(len(full.token_ids))]
        cut = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
        assert cut.finish_reason == "stop"
        end = full.text.index(stop)
        assert cut.text == full.text[:end]
        n = next(n for n in range(len(full.token_ids) + 1) if len(tok.decode(full.token_ids[:n])) >= end + len(stop))
        assert cut.token_ids == full.token_ids[:n]
