"""One Triton model and one endpoint over two tensor-parallel ranks: the real tritonserver, whose
engine process starts the second rank itself, answers what one rank answers, and a stream
cancelled mid-way gives its KV blocks back in both ranks' pools."""
from __future__ import annotations

import pytest

from tests.polling import wait_for
from tests.test_triton_server import offline_text
from tests.triton_fixture import GrpcStreams, ensure_tiny_random_engine, module_server

PROMPTS = ["The quick brown fox", "Once upon a time", "Stop me if you can"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory.mktemp("triton-tp"), name="tp2",
                             overrides={"parallel.tensor_parallel_size": "2"})


@pytest.fixture(scope="module")
def llm():
    """One rank, offline: what the server must answer."""
    from bullet_trt import LLM
    engine = LLM(str(ensure_tiny_random_engine()))
    yield engine
    engine.close()


def rank_free(server, rank: int) -> float:
    return server.metric("bullet_kv_blocks_free_by_rank", rank=rank)


def test_two_ranks_answer_what_one_answers(server, llm):
    assert len(server.engine_pids()) == 2, server.descendants()  # the engine (rank 0) and rank 1
    for prompt in PROMPTS:
        status, body = server.generate({"text_input": prompt, "max_tokens": 16})
        assert status == 200, body
        assert body["text_output"] == offline_text(llm, prompt, max_tokens=16, temperature=0)
    sampling = {"max_tokens": 20, "temperature": 0.9, "top_k": 40, "seed": 1234}
    events = server.generate_stream({"text_input": PROMPTS[1], "stream": True, **sampling})
    assert len(events) > 1 and not any("error" in e for e in events)
    assert "".join(e["text_output"] for e in events) == offline_text(llm, PROMPTS[1], **sampling)


def test_cancelled_stream_frees_kv_blocks_on_both_ranks(server):
    total = server.kv_blocks_total()
    wait_for(lambda: rank_free(server, 0) == rank_free(server, 1) == total, what="both pools empty")
    aborts = server.metric("bullet_requests_finished_total", reason="abort")
    s = GrpcStreams(server.grpc_url)
    rids = [s.send({"text_input": f"A very long story {i}", "max_tokens": 1000, "min_tokens": 1000, "stream": True})
            for i in range(2)]
    for rid in rids:
        kind, _ = s.first(rid)
        assert kind == "result"
    wait_for(lambda: rank_free(server, 0) < total and rank_free(server, 1) < total,
             what="both ranks holding the streams' blocks")
    s.close(cancel=True)
    wait_for(lambda: server.metric("bullet_requests_finished_total", reason="abort") >= aborts + 2,
             what="both requests aborted")
    wait_for(lambda: rank_free(server, 0) == rank_free(server, 1) == total, what="both ranks' pools back to full")
    assert server.metric("bullet_kv_blocks_free") == total
    assert server.metric("bullet_requests_running") == 0
