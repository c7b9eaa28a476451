"""The request id in an error's message (bullet_trt/serving/triton/request_errors.py): what the
model writes, clients read back; tests/test_triton_server.py sees it cross a real gRPC stream
and tests/test_bench.py the load generator end the request it names."""
from __future__ import annotations

import pytest

from bullet_trt.serving.triton.request_errors import split_request_id, with_request_id


@pytest.mark.parametrize("rid", ["b17", "with space", "a:b", "request 3: x", "[bracket", "ünï", "x" * 300])
@pytest.mark.parametrize("message", ["max_tokens must be <= 1023, got 100000", "", "a] b: [c]",
                                     "[request id: other] nested"])
def test_an_id_survives_the_round_trip(rid, message):
    written = with_request_id(message, rid)
    assert written == f"[request id: {rid}] {message}"
    assert split_request_id(written) == (rid, message)


def test_the_form_is_tritons_own():
    # tritonserver puts the same prefix before the errors it raises for a request itself
    assert split_request_id("[request id: t3] unexpected datatype TYPE_FP32 for inference input "
                            "'max_tokens', expecting TYPE_INT32") == (
        "t3", "unexpected datatype TYPE_FP32 for inference input 'max_tokens', expecting TYPE_INT32")


@pytest.mark.parametrize("rid", ["", None, "a]b", "]", "x] y"])
def test_a_request_without_a_representable_id_keeps_its_message(rid):
    assert with_request_id("request cancelled", rid) == "request cancelled"


@pytest.mark.parametrize("message", ["request cancelled", " [request id: b1] not at the start",
                                     "[request id: ] empty id", "[request id: b1]no space after",
                                     "[request id: b1", "[request id: a]b] two brackets", "engine process died"])
def test_a_message_without_the_prefix_names_no_request(message):
    assert split_request_id(message) == (None, message)


def test_a_message_that_names_its_request_already_is_not_named_twice():
    once = with_request_id("server is shutting down", "b4")
    assert with_request_id(once, "b4") == once
    assert with_request_id(once, "b5") == "[request id: b5] " + once
