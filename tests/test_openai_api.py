"""The OpenAI-compatible API end to end: the real tritonserver serving the embedded default
engine, the front end in its own process talking to it over gRPC, and the official `openai`
client (raw HTTP where the client hides what is checked: the SSE framing, the 413).

Two front ends share one tritonserver: `front` with an API key and a chat template given with
--chat-template (the embedded checkpoint has none), `bare` with neither. No test asserts on
wall time.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from bullet_trt.model.corpus_tokenizer import BOS
from bullet_trt.serving.openai import launch as openai_launch
from bullet_trt.serving.triton.server import free_port
from tests.polling import wait_for
from tests.tiny_engine import HELD_TOKENS, LONG_CONTEXT as MAX_MODEL_LEN, tiny_engine
from tests.triton_fixture import pid_alive, start_server

MODEL = "bullet"
KEY = "test-key-123"
# Meta-Llama-3-Instruct's template: the front end renders it and sends the text to Triton.
TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
            "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
            "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
            "{{ content }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]


@dataclass
class Front:
    proc: subprocess.Popen
    port: int
    api_key: str | None
    log_file: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        # No retries: a 429 or 5xx must reach the test as it was answered.
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key or self.api_key or "unused",
                             max_retries=0, timeout=120)

    def post(self, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if self.api_key:
            hdrs["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(f"{self.base_url}{path}", data=body, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return tiny_engine(tmp_path_factory.mktemp("tiny") / "engine", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def triton(tmp_path_factory, engine_dir):
    srv = start_server(tmp_path_factory.mktemp("triton"), "openai", engine_dir=engine_dir)
    yield srv
    srv.stop()


def _start_front(triton, engine_dir: Path, tmp: Path, name: str, api_key: str | None, chat_template: Path | None) -> Front:
    port = free_port()
    log = tmp / f"{name}.log"
    proc = openai_launch.launch(engine_dir, triton.grpc_url, port=port, api_key=api_key,
                                chat_template=chat_template, log_file=log)
    try:
        openai_launch.wait_until_ready(proc, f"http://127.0.0.1:{port}")
    except RuntimeError as e:
        openai_launch.stop(proc)
        raise RuntimeError(f"{e}\n{log.read_text(errors='replace')[-4000:]}") from None
    return Front(proc, port, api_key, log)


@pytest.fixture(scope="module")
def fronts(triton, engine_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    template = tmp / "chat_template.jinja"
    template.write_text(TEMPLATE)
    started = [_start_front(triton, engine_dir, tmp, "front", KEY, template),
               _start_front(triton, engine_dir, tmp, "bare", None, None)]
    yield started
    for f in started:
        openai_launch.stop(f.proc)
        # uvicorn shuts down on SIGTERM and then ends by the signal it caught; a SIGKILL
        # (-9) would mean it did not stop within stop()'s grace period.
        assert f.proc.returncode in (0, -signal.SIGTERM), f.log_file.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def front(fronts) -> Front:
    return fronts[0]


@pytest.fixture(scope="module")
def bare(fronts) -> Front:
    return fronts[1]


@pytest.fixture(scope="module")
def client(front) -> openai.OpenAI:
    return front.client()


def sse_events(body: bytes) -> list[str]:
    return [line[len("data: "):] for line in body.decode().split("\n\n") if line.startswith("data: ")]


# ---------------------------------------------------------------------------------------------

def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_stream_joins_to_the_non_streamed_text(client):
    args = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0)
    whole = client.completions.create(**args)
    choice = whole.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24

    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert len(text_chunks) > 2  # it streamed
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    assert last.choices == [] and last.usage == whole.usage


def test_chat_renders_the_template_and_streams_the_same_text(client):
    args = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0)
    whole = client.chat.completions.create(**args)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason == "length"

    # The same text as a completion of the prompt the template renders: the template is what
    # reached the model. The corpus tokenizer adds BOS itself, so the front end keeps one.
    rendered = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
                       for m in MESSAGES) + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    plain = client.completions.create(model=MODEL, prompt=rendered, max_tokens=20, temperature=0)
    assert msg.content == plain.choices[0].text
    assert whole.usage.prompt_tokens == plain.usage.prompt_tokens
    doubled = client.completions.create(model=MODEL, prompt=BOS + rendered, max_tokens=1, temperature=0)
    assert doubled.usage.prompt_tokens == plain.usage.prompt_tokens + 1

    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_seed_makes_sampling_repeatable(client):
    # temperature 1.0 and top_p 0.9 sample; without the seed reaching the engine each request
    # would draw its own random seed and the texts would differ.
    args = dict(model=MODEL, prompt="Tell me something", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    first = client.completions.create(**args).choices[0].text
    assert client.completions.create(**args).choices[0].text == first
    assert "".join(c.choices[0].text for c in client.completions.create(**args, stream=True)) == first


def test_stream_is_server_sent_events_ending_in_done(front):
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    status, data = front.post("/v1/completions", body)
    assert status == 200
    events = sse_events(data)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    parsed = [json.loads(e) for e in events[:-1]]
    assert parsed[-1]["usage"]["completion_tokens"] == 6 and parsed[-1]["choices"] == []


@pytest.mark.parametrize("stream", [False, True])
def test_stop_cuts_the_text_before_the_stop_string(client, stream):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    text = client.completions.create(**args).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    expected = text[:text.index(stop)]
    for stop_arg in (stop, [stop, "\u2603never"]):
        if stream:
            chunks = list(client.completions.create(**args, stop=stop_arg, stream=True))
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(**args, stop=stop_arg).choices[0]
            got, reason = choice.text, choice.finish_reason
        assert (got, reason) == (expected, "stop")


def test_n_above_one_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2)
    assert e.value.body["param"] == "n" and "n must be 1" in e.value.body["message"]


@pytest.mark.parametrize("endpoint, extra, param, message", [
    ("completions", {"temperature": -0.5}, "temperature", "temperature must be >= 0, got -0.5"),
    ("completions", {"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0"),
    ("completions", {"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
    ("completions", {"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens", f"max_tokens must be <= {MAX_MODEL_LEN - 1}"),
    ("completions", {"seed": -1}, "seed", "seed must be in [0, 2^64), got -1"),
    ("completions", {"prompt": "hello " * (MAX_MODEL_LEN + 100)}, "prompt", "prompt is too long"),
    ("completions", {"prompt": ""}, "prompt", "prompt is empty"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty", "presence_penalty is not supported"),
    ("completions", {"temperature": "hot"}, "temperature", "temperature"),
    ("chat", {"max_completion_tokens": MAX_MODEL_LEN + 1}, "max_completion_tokens",
     f"max_completion_tokens must be <= {MAX_MODEL_LEN - 1}"),
    ("chat", {"messages": []}, "messages", "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 100)}]}, "messages",
     "messages is too long"),
])
def test_bad_values_are_400_naming_the_field(client, endpoint, extra, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "completions":
            client.completions.create(**{"model": MODEL, "prompt": "Hello", "max_tokens": 4, **extra})
        else:
            client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, **extra})
    err = e.value.body
    assert err["param"] == param and message in err["message"] and err["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="Hello", max_tokens=4)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_api_key_is_required_when_set(front, bare):
    with pytest.raises(openai.AuthenticationError) as e:
        front.client(api_key="wrong-key").models.list()
    assert e.value.body["code"] == "invalid_api_key"
    # no Authorization header at all (the openai client always sends one)
    try:
        urllib.request.urlopen(f"{front.base_url}/v1/models", timeout=30)
        status = 200
    except urllib.error.HTTPError as err:
        status = err.code
    assert status == 401
    assert bare.client(api_key="anything").models.list().data[0].id == MODEL


def test_body_over_2_mb_is_413(front):
    body = json.dumps({"model": MODEL, "prompt": "x" * (2 * 1024 * 1024 + 10), "max_tokens": 1}).encode()
    status, data = front.post("/v1/completions", body)  # with Content-Length
    answers = [(status, data)]
    # chunked, with no length declared: counted as it arrives
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=(body[i:i + 65536] for i in range(0, len(body), 65536)),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
                     encode_chunked=True)
        resp = conn.getresponse()
        answers.append((resp.status, resp.read()))
    finally:
        conn.close()
    for status, data in answers:
        assert status == 413
        err = json.loads(data)["error"]
        assert "larger than" in err["message"] and err["code"] == "request_too_large"
        assert set(err) == {"message", "type", "param", "code"}


def test_chat_on_a_model_without_template_is_400(bare):
    with pytest.raises(openai.BadRequestError) as e:
        bare.client().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert e.value.body["code"] == "no_chat_template" and "chat template" in e.value.body["message"]
    # completions still work there
    assert bare.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_client_that_leaves_mid_stream_frees_its_kv_blocks(client, triton, endpoint):
    total = triton.kv_blocks_total()
    aborts = triton.metric("bullet_requests_finished_total", reason="abort")
    # min_tokens (an extension vLLM has too) keeps the request from ending on its own first.
    args = dict(model=MODEL, max_tokens=HELD_TOKENS, temperature=0, stream=True,
                extra_body={"min_tokens": HELD_TOKENS})
    if endpoint == "completions":
        stream = client.completions.create(prompt="A very long story", **args)
    else:
        stream = client.chat.completions.create(messages=MESSAGES, **args)
    with stream:
        for i, _chunk in enumerate(stream):
            if i == 3:
                break
        wait_for(lambda: triton.metric("bullet_kv_blocks_free") < total, what="the request holding KV blocks")
    # Leaving the `with` closed the connection: the front end cancels the Triton request.
    wait_for(lambda: triton.metric("bullet_requests_finished_total", reason="abort") >= aborts + 1,
             what="the request aborted")
    wait_for(lambda: triton.metric("bullet_kv_blocks_free") == total, what="KV blocks back in the pool")


def test_front_end_exits_when_its_parent_dies(triton, engine_dir, tmp_path):
    """A parent killed with SIGKILL has no chance to stop its children; the kernel's
    parent-death signal stops the front end all the same."""
    port = free_port()
    code = ("import sys, time\nfrom bullet_trt.serving.openai import launch\n"
            f"p = launch.launch({str(engine_dir)!r}, {triton.grpc_url!r}, port={port}, "
            f"log_file={str(tmp_path / 'child.log')!r})\n"
            "print(p.pid, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=str(Path(__file__).resolve().parents[1]))
    try:
        child = int(parent.stdout.readline())
        wait_for(lambda: _healthy(port), timeout=120, what="the front end answering")
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not pid_alive(child), timeout=30, what="the front end exiting")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_engine_death_is_429_then_503(engine_dir, tmp_path):
    """Triton's UNAVAILABLE (here: the engine died under a request) is a 429 with Retry-After,
    and a model Triton no longer serves (it unloads itself after that) a 503. Its own server,
    since the engine does not come back."""
    srv = start_server(tmp_path, "dying", engine_dir=engine_dir)
    front = None
    try:
        front = _start_front(srv, engine_dir, tmp_path, "front", None, None)
        total = srv.kv_blocks_total()
        answers: list = []

        def long_request():
            try:
                answers.append(front.client().completions.create(model=MODEL, prompt="A long story",
                                                                 max_tokens=HELD_TOKENS,
                                                                 extra_body={"min_tokens": HELD_TOKENS}))
            except openai.APIStatusError as e:
                answers.append(e)

        t = threading.Thread(target=long_request)
        t.start()
        wait_for(lambda: srv.metric("bullet_kv_blocks_free") < total, what="the request in flight")
        for pid in srv.engine_pids():
            os.kill(pid, signal.SIGKILL)
        t.join(timeout=120)
        (err,) = answers
        assert isinstance(err, openai.RateLimitError), err
        assert err.response.headers["Retry-After"] == "1" and "engine process died" in err.body["message"]

        def not_served() -> str | None:
            if srv.proc.poll() is not None:
                return "tritonserver exited"
            try:
                front.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            except openai.InternalServerError as e:
                return "503" if e.status_code == 503 and e.body["code"] == "model_not_ready" else None
            except openai.RateLimitError:  # refused while the model unloads
                return None
            return None
        outcome = wait_for(not_served, timeout=60, what="503 once the model unloaded itself")
        crash = srv.known_crash() if outcome != "503" else None
        if crash:  # inside the server binary, outside this project's code (docs/serving.md, Health)
            pytest.xfail(f"tritonserver 2.51 crashed: {crash}")
        assert outcome == "503", outcome
    finally:
        if front is not None:
            openai_launch.stop(front.proc)
        srv.stop()
