"""The Triton serving layer, end to end: the real tritonserver from the nvidia-pytriton
wheel, on CPU, serving model_repository/bullet with the embedded default engine.

Also unit tests of the pieces underneath (frontend validation, EngineClient) that need no
server. No test asserts on wall time.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.polling import wait_for
from tests.tiny_engine import HELD_TOKENS, LONG_CONTEXT, tiny_engine
from tests.triton_fixture import GrpcStreams, ensure_tiny_random_engine, module_server, pid_alive, start_server

MODEL = "bullet"


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory.mktemp("triton"))  # its end checks the engine exited


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory) -> Path:
    """For tests that act on a request while it runs: it can hold HELD_TOKENS."""
    return tiny_engine(tmp_path_factory.mktemp("tiny-long") / "engine", max_model_len=LONG_CONTEXT)


@pytest.fixture(scope="module")
def long_server(tmp_path_factory, long_engine):
    yield from module_server(tmp_path_factory.mktemp("triton-long"), engine_dir=long_engine)


@pytest.fixture(scope="module")
def engine_cfg():
    from bullet_trt.config import load_engine_config
    return load_engine_config(ensure_tiny_random_engine())


@pytest.fixture(scope="module")
def llm():
    """The offline engine: the oracle for what the server must return."""
    from bullet_trt import LLM
    engine = LLM(str(ensure_tiny_random_engine()))
    yield engine
    engine.close()


def offline_text(llm, prompt: str, **sampling) -> str:
    from bullet_trt import SamplingParams
    return llm.generate([prompt], SamplingParams(**sampling))[0].text


# ---------------------------------------------------------------------------------------------
# frontend validation (no server)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def frontend(engine_cfg):
    from bullet_trt.model.tokenizer import Tokenizer
    from bullet_trt.engine.validation import RequestLimits
    from bullet_trt.serving.triton.frontend import Frontend, FrontendLimits
    tok = Tokenizer(engine_cfg.tokenizer_path)
    return Frontend(tok, FrontendLimits(RequestLimits(engine_cfg.max_model_len, vocab_size=tok.vocab_size),
                                        default_max_tokens=32))


def _b(text) -> np.ndarray:
    return np.array([[text.encode() if isinstance(text, str) else text]], dtype=object)


def test_frontend_defaults_and_greedy_rule(frontend):
    p = frontend.parse({"text_input": _b("Hello world")})
    assert p.params.temperature == 0 and p.params.max_tokens == 32 and not p.stream
    assert p.exclude_input_in_output is True and p.prompt_token_ids
    # any sampling input switches to sampling with temperature 1.0 by default
    p = frontend.parse({"text_input": _b("Hello"), "top_k": np.array([[5]], np.int32)})
    assert p.params.temperature == 1.0 and p.params.top_k == 5
    # unbatched [1] shapes work the same as batched [1, 1]
    p = frontend.parse({"text_input": np.array([b"Hello"], dtype=object), "max_tokens": np.array([7], np.int32),
                        "stream": np.array([True]), "random_seed": np.array([9], np.uint64),
                        "stop_words": np.array([[b"abc", b""]], dtype=object),
                        "min_length": np.array([3], np.int32)})
    assert (p.params.max_tokens, p.stream, p.params.seed, p.params.stop, p.params.min_tokens) == (7, True, 9, ["abc"], 3)
    assert p.params.stop_token_ids and all(p.params.stop_token_ids)


@pytest.mark.parametrize("inputs, expected", [
    ({}, "text_input is missing"),
    ({"text_input": _b("")}, "text_input is empty"),
    ({"text_input": _b(b"\xff\xfeabc")}, "text_input is not valid UTF-8"),
    ({"text_input": _b("hello " * 1500)}, "the limit is 1023 tokens"),
    ({"max_tokens": np.array([[0]], np.int32)}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": np.array([[5000]], np.int32)}, "max_tokens must be <= 1023"),
    ({"temperature": np.array([[-0.5]], np.float32)}, "temperature must be >= 0"),
    ({"temperature": np.array([[np.nan]], np.float32)}, "temperature must be a finite number"),
    ({"top_p": np.array([[0.0]], np.float32)}, "top_p must be in (0, 1]"),
    ({"top_p": np.array([[1.5]], np.float32)}, "top_p must be in (0, 1]"),
    ({"top_k": np.array([[-1]], np.int32)}, "top_k must be >= 0"),
    ({"min_tokens": np.array([[-2]], np.int32)}, "min_tokens must be >= 0"),
    ({"max_tokens": np.array([[1.5]], np.float32)}, "max_tokens must have datatype INT32"),
    ({"max_tokens": np.array([[4, 5]], np.int32)}, "max_tokens must hold exactly one value, got shape [1,2]"),
    ({"text_input": np.array([[b"a", b"b"]], dtype=object)}, "text_input must hold exactly one value"),
    ({"bad_words": np.array([[b"foo"]], dtype=object)}, "bad_words is not supported"),
    ({"frequency_penalty": np.array([[0.5]], np.float32)}, "frequency_penalty is not supported"),
    ({"end_id": np.array([[999999]], np.int32)}, "end_id must be >= 0 and <= 2047"),
    ({"foo": np.array([[1]], np.int32)}, "unknown input 'foo'"),
])
def test_frontend_rejects_with_field_and_limit(frontend, inputs, expected):
    from bullet_trt.engine.validation import RequestError
    full = {"text_input": _b("Hello")} | inputs if "text_input" not in inputs and inputs != {} else dict(inputs)
    with pytest.raises(RequestError) as e:
        frontend.parse(full)
    assert expected in str(e.value)


def test_frontend_accepts_empty_bad_and_stop_words(frontend):
    # TensorRT-LLM's curl examples send "bad_words": "" and "stop_words": "".
    p = frontend.parse({"text_input": _b("Hello"), "bad_words": _b(""), "stop_words": _b(""),
                        "frequency_penalty": np.array([[0.0]], np.float32)})
    assert p.params.stop == [] and p.params.stop_token_ids == []


# ---------------------------------------------------------------------------------------------
# server set-up helpers (no server)
# ---------------------------------------------------------------------------------------------

def _fake_install(tmp_path):
    from bullet_trt.serving.triton.server import STUB, TritonInstall
    root = tmp_path / "tritonserver"
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    (root / "python_backend_stubs" / ver).mkdir(parents=True)
    (root / "python_backend_stubs" / ver / STUB).write_bytes(b"stub for " + ver.encode())
    (root / "backends" / "python").mkdir(parents=True)
    (root / "backends" / "python" / "libtriton_python.so").write_bytes(b"lib")
    (root / "bin").mkdir()
    return TritonInstall(root, root / "bin" / "tritonserver", root / "backends", tmp_path / "libs",
                         root / "python_backend_stubs")


def test_prepare_backends_copies_the_matching_stub(tmp_path):
    from bullet_trt.serving.triton.server import STUB, prepare_backends
    inst = _fake_install(tmp_path)
    assert prepare_backends(inst) == inst.backends
    assert (inst.backends / "python" / STUB).read_bytes() == inst.stub_for().read_bytes()
    assert prepare_backends(inst) == inst.backends  # idempotent


def test_prepare_backends_falls_back_to_a_cache_copy_when_read_only(tmp_path, monkeypatch):
    from bullet_trt.serving.triton import server
    inst = _fake_install(tmp_path)
    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path / "cache"))

    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")
    monkeypatch.setattr(server.os, "replace", read_only)
    backends = server.prepare_backends(inst)
    assert backends.is_relative_to(tmp_path / "cache")
    assert (backends / "python" / server.STUB).read_bytes() == inst.stub_for().read_bytes()
    assert (backends / "python" / "libtriton_python.so").is_file()
    env = server.server_env(inst, base={"PATH": "/usr/bin"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(inst.libs)
    assert env["BULLET_PYTHON"] == sys.executable


def test_model_parameters_and_engine_dir_resolution(tmp_path, monkeypatch):
    from bullet_trt.serving.triton.model import model_parameters, resolve_engine_dir
    cfg = {"parameters": {"engine_dir": {"string_value": "engines/x"},
                          "serve.mode": {"string_value": "chunked"},
                          "kv.block_size": {"string_value": "${unset}"}}}
    monkeypatch.setenv("BULLET_OVERRIDES", json.dumps({"kv.cpu_pool_mib": 32}))
    params, overrides = model_parameters(cfg)
    assert params["engine_dir"] == "engines/x" and params["default_max_tokens"] == "64"
    assert overrides == {"serve.mode": "chunked", "kv.cpu_pool_mib": "32"}
    with pytest.raises(ValueError, match="unknown parameter 'bogus'"):
        model_parameters({"parameters": {"bogus": {"string_value": "1"}}})
    root = tmp_path / "proj"
    (root / "engines" / "x").mkdir(parents=True)
    (root / "engines" / "x" / "engine.yaml").write_text("{}\n")
    (root / "model_repository" / "bullet").mkdir(parents=True)
    monkeypatch.delenv("BULLET_ENGINE_DIR", raising=False)
    assert resolve_engine_dir("engines/x", root / "model_repository" / "bullet") == root / "engines" / "x"
    monkeypatch.setenv("BULLET_ENGINE_DIR", str(ensure_tiny_random_engine()))
    assert resolve_engine_dir("engines/x", root / "model_repository" / "bullet") == ensure_tiny_random_engine()
    monkeypatch.setenv("BULLET_ENGINE_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="build_engines.py"):
        resolve_engine_dir("engines/x", None)


# ---------------------------------------------------------------------------------------------
# EngineClient (engine in its own process, no Triton)
# ---------------------------------------------------------------------------------------------

def _collect_cb():
    outs, done = [], threading.Event()

    def cb(o):
        outs.append(o)
        if o.finished:
            done.set()
    return outs, done, cb


def test_engine_client_streams_aborts_and_rejects(engine_cfg):
    from bullet_trt.engine.request import NewRequest
    from bullet_trt.engine.sampling import SamplingParams
    from bullet_trt.serving.engine_process import EngineClient

    ec = EngineClient(engine_cfg, factory="tests.triton_fixture:FakeCore", stats_interval=0.01).start()
    try:
        assert ec.is_ready() and ec.info.max_prompt_len == engine_cfg.max_prompt_len
        outs, done, cb = _collect_cb()
        ec.add_request(NewRequest("a", [1, 2], SamplingParams(max_tokens=5)), cb)
        assert done.wait(30)
        assert [t for o in outs for t in o.new_token_ids] == [0, 1, 2, 3, 4] and outs[-1].finish_reason == "length"

        outs, done, cb = _collect_cb()
        ec.add_request(NewRequest("b", [1], SamplingParams(max_tokens=10 ** 6)), cb)
        wait_for(lambda: outs, what="first output")
        ec.abort("b")
        assert done.wait(30) and outs[-1].finish_reason == "abort"
        wait_for(lambda: ec.stats().kv_blocks_free == 10, what="blocks freed")

        outs, done, cb = _collect_cb()
        ec.add_request(NewRequest("c", [1] * 5000, SamplingParams(max_tokens=3)), cb)
        assert done.wait(30)
        assert outs[-1].finish_reason == "rejected" and "the limit is 1023" in outs[-1].error
    finally:
        ec.shutdown()
    assert not ec.is_ready()


@pytest.mark.parametrize("first_token, expect", [(666, "boom: the fake engine failed"),
                                                  (667, "engine process died (exit code 3)")])
def test_engine_client_failure_errors_in_flight_requests(engine_cfg, first_token, expect):
    from bullet_trt.engine.request import NewRequest
    from bullet_trt.engine.sampling import SamplingParams
    from bullet_trt.serving.engine_process import EngineClient, EngineUnavailable

    died = threading.Event()
    ec = EngineClient(engine_cfg, factory="tests.triton_fixture:FakeCore",
                      on_death=lambda reason: died.set()).start()
    try:
        slow_outs, slow_done, slow_cb = _collect_cb()
        ec.add_request(NewRequest("slow", [1], SamplingParams(max_tokens=10 ** 6)), slow_cb)
        wait_for(lambda: slow_outs, what="first output")
        outs, done, cb = _collect_cb()
        ec.add_request(NewRequest("bad", [first_token], SamplingParams(max_tokens=5)), cb)
        assert done.wait(30) and slow_done.wait(30) and died.wait(30)
        for o in (outs[-1], slow_outs[-1]):
            assert o.finish_reason == "error" and expect in o.error
        assert not ec.is_ready() and expect in ec.failure
        with pytest.raises(EngineUnavailable):
            ec.add_request(NewRequest("late", [1], SamplingParams()), cb)
    finally:
        ec.shutdown()


class _OverlapMetricFamily:
    """A stand-in for pb_utils.MetricFamily whose metrics record how many calls were ever inside
    the backend at once (the real backend corrupts its shared memory when two overlap)."""

    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
    inside = 0
    most_inside = 0
    calls = 0
    guard = threading.Lock()
    fail = False

    def __init__(self, name, description, kind):
        pass

    def Metric(self, labels, buckets=None):  # noqa: N802 - the backend's name
        return _OverlapMetric()


class _OverlapMetric:
    def _op(self, value):
        fam = _OverlapMetricFamily
        with fam.guard:
            fam.inside += 1
            fam.calls += 1
            fam.most_inside = max(fam.most_inside, fam.inside)
        time.sleep(0.0005)  # the IPC round trip to the server, without the GIL
        with fam.guard:
            fam.inside -= 1
        if fam.fail:
            raise RuntimeError("metric backend gone")

    set = increment = observe = _op


def test_metrics_never_overlap_backend_calls_and_never_raise():
    """The reader thread (failing open requests), execute() (refusing new ones) and the stats
    callback all count metrics at once when an engine dies under load."""
    from types import SimpleNamespace

    from bullet_trt.engine.request import EngineStats
    from bullet_trt.serving.triton.metrics import Metrics

    fam = _OverlapMetricFamily
    fam.inside = fam.most_inside = fam.calls = 0
    fam.fail = False
    m = Metrics(SimpleNamespace(MetricFamily=fam), {"model": "bullet", "version": "1"})
    start = threading.Barrier(4)

    def hammer(fn):
        start.wait()
        for i in range(60):
            fn(i)

    threads = [threading.Thread(target=hammer, args=(fn,)) for fn in (
        lambda i: m.request_finished("error"),
        lambda i: m.request_finished("error"),
        lambda i: m.observe_ttft(0.01 * i),
        lambda i: m.update_stats(EngineStats(num_running=i, kv_blocks_total=64, kv_blocks_free=64 - i,
                                             tokens_generated=i)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert fam.calls > 200
    assert fam.most_inside == 1
    assert m.finished["error"] == 120

    fam.fail = True  # a failing backend must not stop a request's final response
    m.request_finished("stop")
    m.observe_tpot(0.01)
    m.close()
    calls = fam.calls
    m.request_finished("error")  # after close: counted here, never sent to the backend
    assert fam.calls == calls and m.finished["error"] == 121


# ---------------------------------------------------------------------------------------------
# the running server
# ---------------------------------------------------------------------------------------------

def test_server_ready_and_model_config(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http = httpclient.InferenceServerClient(server.http_url)
    assert http.is_server_live() and http.is_server_ready() and http.is_model_ready(MODEL)
    config = http.get_model_config(MODEL)
    assert config["model_transaction_policy"]["decoupled"] is True
    names = {i["name"] for i in http.get_model_metadata(MODEL)["inputs"]}
    assert {"text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed", "random_seed",
            "stop_words", "bad_words", "end_id", "pad_id", "min_tokens", "min_length",
            "exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens",
            "return_log_probs"} <= names
    outputs = {o["name"] for o in http.get_model_metadata(MODEL)["outputs"]}
    assert outputs == {"text_output", "num_input_tokens", "num_output_tokens", "cum_log_probs", "output_log_probs"}
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert grpc.is_model_ready(MODEL)
    grpc.close()
    http.close()


def test_http_generate_matches_offline_engine(server, llm):
    prompt = "The quick brown fox"
    want = offline_text(llm, prompt, max_tokens=16, temperature=0)
    status, body = server.generate({"text_input": prompt, "max_tokens": 16})  # no sampling input: greedy
    assert status == 200, body
    assert body["text_output"] == want
    status, body = server.generate({"text_input": prompt, "max_tokens": 16, "exclude_input_in_output": False,
                                    "return_num_input_tokens": True, "return_num_output_tokens": True})
    assert body["text_output"] == prompt + want
    assert body["num_input_tokens"] == len(llm.tokenizer.encode(prompt)) and body["num_output_tokens"] == 16


def test_http_generate_stream_concatenates_to_non_streaming(server, llm):
    prompt = "Once upon a time"
    sampling = {"max_tokens": 24, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 1234}
    want = offline_text(llm, prompt, **sampling)
    status, whole = server.generate({"text_input": prompt, **sampling})
    assert status == 200 and whole["text_output"] == want
    events = server.generate_stream({"text_input": prompt, "stream": True, "return_num_output_tokens": True,
                                     **sampling})
    assert len(events) > 1 and not any("error" in e for e in events)
    assert "".join(e["text_output"] for e in events) == want
    assert sum(e["num_output_tokens"] for e in events) == 24


def test_grpc_streaming_and_non_streaming_agree(server, llm):
    prompt = "In a hole in the ground"
    sampling = {"max_tokens": 20, "temperature": 0.8, "seed": 77}
    want = offline_text(llm, prompt, **sampling)
    s = GrpcStreams(server.grpc_url)
    try:
        whole = s.collect(s.send({"text_input": prompt, "stream": False, **sampling}))
        assert whole.error is None and whole.final and whole.pieces == [want]
        streamed = s.collect(s.send({"text_input": prompt, "stream": True, "return_log_probs": True,
                                     "return_num_input_tokens": True, **sampling}))
        assert streamed.error is None and streamed.final
        texts = [p for p in streamed.pieces if p]
        assert len(texts) > 1, "streaming must answer piece by piece"
        assert streamed.text == want
        r = streamed.responses[0]
        assert int(r.as_numpy("num_input_tokens").reshape(-1)[0]) == len(llm.tokenizer.encode(prompt))
        logprobs = np.concatenate([x.as_numpy("output_log_probs").reshape(-1) for x in streamed.responses
                                   if x.as_numpy("output_log_probs") is not None])
        assert logprobs.size == 20 and np.all(logprobs <= 0)
        cum = streamed.responses[-1].as_numpy("cum_log_probs").reshape(-1)[0]
        assert cum == pytest.approx(float(logprobs.sum()), rel=1e-4, abs=1e-3)
        echoed = s.collect(s.send({"text_input": prompt, "exclude_input_in_output": False, **sampling}))
        assert echoed.text == prompt + want
    finally:
        s.close()


def test_stop_words_and_end_id_match_offline_engine(server, llm):
    from bullet_trt import SamplingParams
    prompt = "Stop me if you can"
    full = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    tok = llm.tokenizer
    # a stop word that is exactly one of the output tokens, so its token ids are unambiguous
    k = next(i for i, t in enumerate(full.token_ids[4:], 4)
             if tok.decode([t]).strip() and tok.stop_sequences([tok.decode([t])]) == [[t]])
    word = tok.decode([full.token_ids[k]])
    want = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[word]))[0]
    assert want.finish_reason == "stop" and len(want.token_ids) <= k + 1
    status, body = server.generate({"text_input": prompt, "max_tokens": 24, "stop_words": [word],
                                    "return_num_output_tokens": True})
    assert status == 200 and body["text_output"] == want.text
    assert body["num_output_tokens"] == len(want.token_ids)
    end_id = full.token_ids[3]
    want = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, end_id=end_id))[0]
    status, body = server.generate({"text_input": prompt, "max_tokens": 24, "end_id": end_id})
    assert status == 200 and body["text_output"] == want.text and len(want.token_ids) <= 3


def test_sixteen_concurrent_streams_all_finish(server):
    before = server.metric("bullet_requests_finished_total", reason="length")
    s = GrpcStreams(server.grpc_url)
    try:
        rids = [s.send({"text_input": f"Request number {i} says", "max_tokens": 12 + i, "min_tokens": 12 + i,
                        "stream": True, "temperature": 0.7, "seed": i, "return_num_output_tokens": True})
                for i in range(16)]
        results = [s.collect(rid) for rid in rids]
    finally:
        s.close()
    for i, res in enumerate(results):
        assert res.error is None and res.final, (i, res.error)
        counts = [int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in res.responses
                  if r.as_numpy("num_output_tokens") is not None]
        assert sum(counts) == 12 + i
        assert len(res.responses) > 1
    wait_for(lambda: server.metric("bullet_requests_finished_total", reason="length") >= before + 16,
             what="16 finished requests in the metrics")


def test_cancelled_grpc_stream_frees_kv_blocks(long_server):
    server = long_server
    total = server.kv_blocks_total()
    aborts = server.metric("bullet_requests_finished_total", reason="abort")
    s = GrpcStreams(server.grpc_url)
    rids = [s.send({"text_input": f"A very long story {i}", "max_tokens": HELD_TOKENS, "min_tokens": HELD_TOKENS,
                    "stream": True}) for i in range(2)]
    for rid in rids:
        kind, _ = s.first(rid)
        assert kind == "result"
    assert server.metric("bullet_kv_blocks_free") < total
    s.close(cancel=True)
    wait_for(lambda: server.metric("bullet_requests_finished_total", reason="abort") >= aborts + 2,
             what="both requests aborted")
    wait_for(lambda: server.metric("bullet_kv_blocks_free") == total, what="KV-free metric back to full")
    assert server.metric("bullet_requests_running") == 0

    # an HTTP client that hangs up on generate_stream cancels its request the same way
    import urllib.request
    body = {"text_input": "Another long story", "max_tokens": HELD_TOKENS, "min_tokens": HELD_TOKENS, "stream": True}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/generate_stream",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    assert resp.readline().startswith(b"data:")
    resp.close()
    wait_for(lambda: server.metric("bullet_requests_finished_total", reason="abort") >= aborts + 3,
             what="the HTTP request aborted")
    wait_for(lambda: server.metric("bullet_kv_blocks_free") == total, what="KV-free metric back to full")


BAD_INPUTS = [
    # (description, fields, types override, shapes override, substrings the error must hold)
    ("missing text_input", {"max_tokens": 4}, None, None, ["text_input"]),
    ("empty text_input", {"text_input": ""}, None, None, ["text_input is empty"]),
    ("non-UTF-8 bytes", {"text_input": b"\xc3\x28 bad"}, None, None, ["text_input is not valid UTF-8"]),
    ("prompt too long", {"text_input": "hello " * 1500}, None, None, ["text_input is too long", "1023"]),
    ("max_tokens zero", {"text_input": "hi", "max_tokens": 0}, None, None, ["max_tokens", ">= 1"]),
    ("max_tokens negative", {"text_input": "hi", "max_tokens": -3}, None, None, ["max_tokens", ">= 1"]),
    ("max_tokens above limit", {"text_input": "hi", "max_tokens": 100000}, None, None, ["max_tokens", "<= 1023"]),
    ("negative temperature", {"text_input": "hi", "temperature": -1.0}, None, None, ["temperature", ">= 0"]),
    ("top_p zero", {"text_input": "hi", "top_p": 0.0}, None, None, ["top_p", "(0, 1]"]),
    ("top_p above one", {"text_input": "hi", "top_p": 1.5}, None, None, ["top_p", "(0, 1]"]),
    ("negative top_k", {"text_input": "hi", "top_k": -1}, None, None, ["top_k", ">= 0"]),
    ("wrong dtype", {"text_input": "hi", "max_tokens": 4.0}, {"max_tokens": "FP32"}, None, ["max_tokens", "INT32"]),
    ("wrong shape", {"text_input": ["a", "b"]}, None, {"text_input": (1, 2)}, ["text_input", "shape"]),
    ("unbatched shape", {"text_input": "hi"}, None, {"text_input": (1,)}, ["text_input", "shape"]),
    ("unknown input", {"text_input": "hi", "no_such_input": 3}, {"no_such_input": "INT32"}, None,
     ["no_such_input"]),
    ("bad_words", {"text_input": "hi", "bad_words": ["foo", "bar"]}, None, None, ["bad_words", "not supported"]),
]


# tritonserver refuses these itself, before the model sees them, with a message naming no
# request (tritonserver 2.51); its other refusals (a wrong type or shape) start with the id as
# the model's errors do.
TRITON_ERRORS_WITHOUT_ID = {"unknown input"}


def test_bad_inputs_get_errors_while_others_keep_streaming(server):
    """Each error names the request it ends, in the form request_errors.py reads back: the gRPC
    stream hands the callback an error without its request's id."""
    from bullet_trt.serving.triton.request_errors import split_request_id
    good = GrpcStreams(server.grpc_url)
    bad = GrpcStreams(server.grpc_url)
    try:
        rid = good.send({"text_input": "Keep talking", "max_tokens": 200, "min_tokens": 200, "stream": True,
                         "return_num_output_tokens": True})
        first = good.first(rid)
        assert first[0] == "result"
        for name, fields, types, shapes, expected in BAD_INPUTS:
            bad_rid = None
            try:
                bad_rid = bad.send(fields, types=types, shapes=shapes)
                res = bad.collect(bad_rid, timeout=60)
                error = res.error
            except Exception as e:  # the client refuses some inputs itself
                error = str(e)
            assert error is not None, f"{name}: no error"
            for sub in expected:
                assert sub in error, f"{name}: {sub!r} not in {error!r}"
            if bad_rid is not None and name not in TRITON_ERRORS_WITHOUT_ID:
                assert split_request_id(error)[0] == bad_rid, f"{name}: {error!r} does not name {bad_rid}"
                assert error.startswith(f"[request id: {bad_rid}] "), error
        rest = good.collect(rid)
        assert rest.error is None and rest.final, rest.error
        counts = [int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in [first[1]] + rest.responses
                  if r.as_numpy("num_output_tokens") is not None]
        assert sum(counts) == 200
    finally:
        good.close()
        bad.close()
    # the same errors reach HTTP clients of the generate endpoint, as 400s; without an id they
    # name no request
    status, body = server.generate({"text_input": "hi", "max_tokens": 0})
    assert status == 400 and body["error"].startswith("max_tokens must be >= 1"), body
    status, body = server.generate({"id": "h1", "text_input": "hi", "max_tokens": 0})
    assert status == 400 and body["error"].startswith("[request id: h1] max_tokens must be >= 1"), body
    status, body = server.generate({"text_input": "hi", "top_p": 2.0})
    assert status == 400 and "top_p" in body["error"]


def test_metrics_endpoint_exposes_custom_metrics(server):
    from bullet_trt.serving.triton.metrics import NAMES
    text = server.metrics_text()
    for name in NAMES:
        assert f"# TYPE {name} " in text, name
    assert server.metric("bullet_time_to_first_token_seconds_count") > 0
    assert server.metric("bullet_time_per_output_token_seconds_count") > 0
    assert server.metric("bullet_generation_tokens_total") > 0
    assert server.metric("bullet_engine_ready") == 1
    assert server.metric("bullet_kv_blocks_used") == 0
    assert server.metric("bullet_requests_waiting") == 0


def _perf_analyzer_env() -> dict:
    import importlib.util
    env = dict(os.environ)
    libs = []
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is not None and spec.submodule_search_locations:
        libs.append(str(Path(list(spec.submodule_search_locations)[0]) / "lib"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    return env


def test_perf_analyzer_streaming_run(server, tmp_path):
    pa = Path(sys.executable).parent / "perf_analyzer"
    if not pa.is_file():
        pa = Path(shutil.which("perf_analyzer") or "perf_analyzer")
    assert pa.is_file(), "perf_analyzer not found: run scripts/setup.sh (tritonclient[all]==2.51.0)"
    data = {"data": [{"text_input": [f"Benchmark prompt {i}"], "max_tokens": [8], "stream": [True]}
                     for i in range(4)]}
    (tmp_path / "inputs.json").write_text(json.dumps(data))
    cmd = [str(pa), "-m", MODEL, "-u", server.grpc_url, "-i", "grpc", "--streaming",
           "--input-data", str(tmp_path / "inputs.json"), "--concurrency-range", "2",
           # a fixed number of requests: one measurement, no stability loop (the host may be busy)
           "--measurement-mode", "count_windows", "--measurement-request-count", "8", "--request-count", "16"]
    r = subprocess.run(cmd, env=_perf_analyzer_env(), capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert "error while loading shared libraries" not in out, (
        f"perf_analyzer cannot start ({out.strip()}): run scripts/setup.sh (libb64-0d, nvidia-cuda-runtime-cu12)")
    assert r.returncode == 0, out
    assert "Throughput" in out, out


def test_engine_death_errors_in_flight_and_model_goes_not_ready(long_engine, tmp_path_factory):
    """Its own server (this test kills the engine), in bullet mode: the engine process runs a
    prefill and a decode worker process of its own, which must not outlive it."""
    import tritonclient.http as httpclient

    srv = start_server(tmp_path_factory.mktemp("triton-death"), name="death", overrides={"serve.mode": "bullet"},
                       engine_dir=long_engine)
    try:
        status, body = srv.generate({"text_input": "Spatial sharing", "max_tokens": 8})
        assert status == 200 and body["text_output"], body
        metrics = srv.metrics_text()
        assert "bullet_prefill_sms" in metrics
        corrections = re.findall(r'bullet_perf_model_correction\{[^}]*phase="(prefill|decode)"[^}]*\} (\S+)', metrics)
        assert sorted(phase for phase, _ in corrections) == ["decode", "prefill"]
        assert all(float(value) > 0 for _, value in corrections)  # bullet plans from a model: not 0
        s = GrpcStreams(srv.grpc_url)
        rid = s.send({"text_input": "Never ending", "max_tokens": HELD_TOKENS, "min_tokens": HELD_TOKENS,
                      "stream": True})
        assert s.first(rid)[0] == "result"
        pids = srv.engine_pids()
        assert len(pids) >= 1, srv.descendants()
        os.kill(pids[0], signal.SIGKILL)
        res = s.collect(rid, timeout=60)
        assert res.error is not None and "engine process died" in res.error
        assert res.error.startswith(f"[request id: {rid}] "), res.error  # the stream drops its id
        http = httpclient.InferenceServerClient(srv.http_url)
        wait_for(lambda: not http.is_model_ready(MODEL), what="model reported not ready")
        assert not http.is_server_ready()  # strict readiness follows the model
        late = s.collect(s.send({"text_input": "anyone there?"}), timeout=60)
        assert late.error is not None
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="engine workers exit")
        s.close()
        http.close()
    finally:
        srv.stop()


MODE_PROMPTS = ["Spatial sharing of one GPU", "The decode phase reads every weight", "Ab"]


def greedy_texts(srv) -> list[str]:
    texts = []
    for prompt in MODE_PROMPTS:
        status, body = srv.generate({"text_input": prompt, "max_tokens": 12, "min_tokens": 12})
        assert status == 200, body
        texts.append(body["text_output"])
    return texts


@pytest.mark.parametrize("mode", ["bullet", "static"])
def test_modes_serve_identical_greedy_outputs(long_server, long_engine, tmp_path_factory, mode):
    """Both spatial modes (prefill and decode worker processes behind the real tritonserver)
    answer exactly what the chunked-prefill default answers; in bullet mode, a decode worker
    that dies errors its in-flight request, the model goes not ready, nothing lingers. On the
    engine that holds HELD_TOKENS: a request of 1000 tokens could end before a busy client had
    read its first response and the worker was killed."""
    import tritonclient.http as httpclient

    overrides = {"serve.mode": mode, "serve.chunk_size": 16}
    if mode == "static":
        overrides["serve.static_prefill_sms"] = 8
    reference = greedy_texts(long_server)
    srv = start_server(tmp_path_factory.mktemp(f"triton-{mode}"), name=mode, overrides=overrides,
                       engine_dir=long_engine)
    try:
        assert greedy_texts(srv) == reference
        if mode != "bullet":
            return
        pids = srv.engine_pids()
        assert len(pids) == 3, srv.descendants()  # the engine and its two workers
        s = GrpcStreams(srv.grpc_url)
        rid = s.send({"text_input": "Never ending", "max_tokens": HELD_TOKENS, "min_tokens": HELD_TOKENS,
                      "stream": True})
        assert s.first(rid)[0] == "result"
        os.kill(pids[2], signal.SIGKILL)  # a worker, not the engine
        res = s.collect(rid, timeout=60)
        assert res.error is not None
        http = httpclient.InferenceServerClient(srv.http_url)
        wait_for(lambda: not http.is_model_ready(MODEL), what="model reported not ready")
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="engine and workers exit")
        s.close()
        http.close()
    finally:
        srv.stop()


def test_a_port_taken_before_tritonserver_binds_it_gets_other_ports(tmp_path, monkeypatch):
    """Free ports are picked before tritonserver binds them, which it does only once the model
    has loaded: a port another process binds in between makes tritonserver exit, and the start
    is tried again on fresh ports (server.on_free_ports), here with a port held by a real socket."""
    import socket

    from bullet_trt.serving.triton import server as srv
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    real_free_ports = srv.free_ports
    picks: list[list[int]] = []

    def first_with_a_taken_grpc_port(n: int) -> list[int]:
        ports = real_free_ports(n)
        if not picks:
            ports[1] = taken
        picks.append(ports)
        return ports
    monkeypatch.setattr(srv, "free_ports", first_with_a_taken_grpc_port)
    try:
        server = start_server(tmp_path, name="ports")
    finally:
        holder.close()
    try:
        assert len(picks) == 2 and server.grpc_port != taken
        assert srv.PORT_TAKEN in server.log_file.read_text(errors="replace")  # the first start's words
        streams = GrpcStreams(server.grpc_url)
        try:
            answer = streams.collect(streams.send({"text_input": "the ports", "max_tokens": 2}))
        finally:
            streams.close()
        assert answer.final and answer.error is None and answer.text
    finally:
        server.stop()
