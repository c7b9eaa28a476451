"""Bad input on Triton's HTTP generate endpoint: what reaches the model gets a 400 naming the
field and the limit, also for a multi-megabyte prompt (refused before it is tokenized); what
Triton's own JSON-to-tensor conversion refuses never reaches the model, and answers as
docs/serving.md says."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.tiny_engine import tiny_engine
from tests.triton_fixture import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = tiny_engine(tmp_path_factory.mktemp("tiny") / "engine")
    srv = start_server(tmp_path_factory.mktemp("triton-http"), engine_dir=engine)
    yield srv
    srv.stop()


def post(server, body: str | bytes) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/bullet/generate", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


OURS = [  # (body, what the error must say)
    ('{"text_input": "hi", "temperature": NaN}', "temperature must be a finite number, got nan"),
    ('{"text_input": "hi", "temperature": Infinity}', "temperature must be a finite number, got inf"),
    ('{"text_input": "hi", "top_p": NaN}', "top_p must be a finite number"),
    ('{"text_input": "hi", "temperature": -1}', "temperature must be >= 0"),
    ('{"text_input": "hi", "max_tokens": 0}', "max_tokens must be >= 1, got 0"),
    ('{"text_input": "hi", "max_tokens": 5000}', "max_tokens must be <= 511 (max_model_len 512"),
    ('{"text_input": "hi", "top_k": -1}', "top_k must be >= 0"),
    ('{"text_input": "hi", "min_tokens": -3}', "min_tokens must be >= 0"),
    ('{"text_input": ""}', "text_input is empty"),
    ('{"max_tokens": 8}', "text_input is missing"),
    ('{"text_input": "\\udcff"}', "text_input is not valid UTF-8"),
    ('{"text_input": "hi", "end_id": 999999}', "end_id must be >= 0 and <= 2047"),
    ('{"text_input": "hi", "bad_words": ["x"]}', "bad_words is not supported"),
    (json.dumps({"text_input": "hi", "stop_words": [str(i) for i in range(17)]}), "stop_words holds 17 words; the limit is 16"),
]


@pytest.mark.parametrize("body, says", OURS, ids=[says.split(" ")[0] + f"-{i}" for i, (_, says) in enumerate(OURS)])
def test_bad_values_get_400_naming_the_field_and_the_limit(server, body, says):
    status, answer = post(server, body)
    assert status == 400 and says in answer["error"], (status, answer)


def test_a_two_megabyte_prompt_is_refused_by_its_size_in_bytes(server):
    status, answer = post(server, json.dumps({"text_input": "word " * 400_000, "max_tokens": 8}))
    assert status == 400
    assert "text_input is too long: 2000000 bytes" in answer["error"] and "511 tokens" in answer["error"]
    # the server is fine afterwards
    status, answer = post(server, json.dumps({"text_input": "hi", "max_tokens": 2}))
    assert status == 200 and "text_output" in answer


TRITONS = [  # refused by Triton's JSON-to-tensor conversion, before the model: docs/serving.md
    ('{"text_input": "hi", "max_tokens": "8"}', 500, "attempt to access JSON non-signed-integer as signed-integer"),
    ('{"text_input": "hi", "max_tokens": 8.5}', 500, "attempt to access JSON non-signed-integer as signed-integer"),
    ('{"text_input": "hi", "temperature": "0.5"}', 500, "attempt to access JSON non-number as double"),
    ('{"text_input": "hi", "stream": "yes"}', 500, "attempt to access JSON non-boolean as boolean"),
    ('{"text_input": "hi", "seed": -1}', 500, "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ('{"text_input": 123}', 500, "attempt to access JSON non-string as string"),
    ('not json', 500, "failed to parse the request JSON buffer"),
    ('{"text_input": "hi", "max_tokens": [1, 2]}', 400, "batch size does not match"),
]


@pytest.mark.parametrize("body, status, says", TRITONS)
def test_wrong_json_types_are_refused_by_triton_as_documented(server, body, status, says):
    got, answer = post(server, body)
    assert (got, says in answer["error"]) == (status, True), (got, answer)


def test_triton_truncates_a_too_large_integer_before_the_model_sees_it(server):
    # 99999999999 arrives as the INT32 1215752191 (its low 32 bits): the model names what it got
    status, answer = post(server, '{"text_input": "hi", "max_tokens": 99999999999}')
    assert status == 400 and "got 1215752191" in answer["error"]
