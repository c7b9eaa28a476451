"""Streamed text through the real tritonserver, on a tiny random engine whose byte-level BPE
output is full of multi-byte characters split across tokens: streamed pieces join to exactly
the non-streamed text, no piece carries a U+FFFD the full text does not, and stop strings are
cut wherever the tokens split them, end the request and free its KV blocks."""
from __future__ import annotations


import pytest

from tests.polling import wait_for
from tests.test_text_stream import _bytes_to_unicode
from tests.tiny_engine import tiny_engine
from tests.triton_fixture import GrpcStreams, start_server

PROMPTS = ["東京の天気は", "I love 🐍 and 🚀! 😎", "北京的天气很好。서울의 밤은", "café naïve Straße"]
SAMPLING = [dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2)]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("tiny") / "engine")


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine_dir):
    srv = start_server(tmp_path_factory.mktemp("triton-text"), engine_dir=engine_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm(engine_dir):
    from bullet_trt import LLM
    with LLM(str(engine_dir)) as engine:
        yield engine


def split_characters(tok, ids: list[int]) -> list[str]:
    """Multi-byte characters of the output whose bytes come from more than one token."""
    from_char = {c: b for b, c in _bytes_to_unicode().items()}
    bounds, data = set(), b""
    for i in ids:
        data += bytes(from_char[c] for c in tok._tok.id_to_token(i))
        bounds.add(len(data))
    found, pos = [], 0
    while pos < len(data):
        for n in (4, 3, 2, 1):
            try:
                ch = data[pos:pos + n].decode("utf-8")
            except UnicodeDecodeError:
                continue
            if n > 1 and any(pos < b < pos + n for b in bounds):
                found.append(ch)
            pos += n
            break
        else:
            pos += 1  # a byte that starts no character: the decoder's U+FFFD
    return found


def test_streamed_pieces_join_to_the_non_streamed_text(server, llm):
    from bullet_trt import SamplingParams

    split_seen = []
    s = GrpcStreams(server.grpc_url)
    try:
        for prompt in PROMPTS:
            for sampling in SAMPLING:
                want = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, **sampling))[0]
                split_seen += split_characters(llm.tokenizer, want.token_ids)
                fields = {"text_input": prompt, "max_tokens": MAX_TOKENS, **sampling}
                status, body = server.generate(fields)
                assert status == 200, body
                assert body["text_output"] == want.text
                streamed = s.collect(s.send({**fields, "stream": True}))
                assert streamed.error is None and streamed.final
                assert streamed.text == want.text, (prompt, sampling)
                # each piece arrived as valid UTF-8 (the helper decodes strictly), and a piece
                # carries U+FFFD only where the whole text has one
                assert sum(p.count("\ufffd") for p in streamed.pieces) == want.text.count("\ufffd")
    finally:
        s.close()
    assert split_seen, "no output split a multi-byte character across tokens: the test proves nothing"


def _spanning_stop(tok, ids: list[int]) -> str:
    """Two ASCII characters from the end of one output token and two from the start of the next."""
    return next(tok.decode([a])[-2:] + tok.decode([b])[:2] for a, b in zip(ids[2:], ids[3:])
                if len(tok.decode([a]).strip()) >= 2 and len(tok.decode([b]).strip()) >= 2
                and tok.decode([a]).isascii() and tok.decode([b]).isascii())


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens_is_cut_ends_the_request_and_frees_its_blocks(server, llm, stream):
    from bullet_trt import SamplingParams

    prompt = "The quick brown fox"
    full = llm.generate([prompt], SamplingParams(max_tokens=200, min_tokens=200, temperature=0))[0]
    stop = _spanning_stop(llm.tokenizer, full.token_ids)
    assert llm.tokenizer.stop_sequences([stop])[0] not in [full.token_ids[i:i + 2] for i in range(200)]
    want = llm.generate([prompt], SamplingParams(max_tokens=200, temperature=0, stop=[stop]))[0]
    assert want.finish_reason == "stop" and want.text == full.text[:full.text.index(stop)]
    assert len(want.token_ids) < 200

    total = server.kv_blocks_total()
    stops = server.metric("bullet_requests_finished_total", reason="stop")
    fields = {"text_input": prompt, "max_tokens": 200, "stop_words": [stop], "return_num_output_tokens": True}
    if stream:
        s = GrpcStreams(server.grpc_url)
        try:
            res = s.collect(s.send({**fields, "stream": True}))
        finally:
            s.close()
        assert res.error is None and res.final
        text = res.text
        tokens = sum(int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in res.responses
                     if r.as_numpy("num_output_tokens") is not None)
    else:
        status, body = server.generate(fields)
        assert status == 200, body
        text, tokens = body["text_output"], body["num_output_tokens"]
    assert text == want.text  # pieces are never taken back: none carried any of the stop string
    assert tokens == len(want.token_ids)
    wait_for(lambda: server.metric("bullet_requests_finished_total", reason="stop") == stops + 1,
         what="the request counted as stopped")
    wait_for(lambda: server.metric("bullet_kv_blocks_free") == total, what="its KV blocks back in the pool")
    assert server.metric("bullet_requests_running") == 0
