"""The real tritonserver on a GPU in bullet mode: the engine process and its two workers
(MPS clients on green-context partitions) behind model_repository/bullet, under a concurrent
HTTP load. tritonserver comes from the nvidia-pytriton wheel (scripts/gpu_run.sh installs the
carried copy on machines without registry access); the engine is the embedded default.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time

import pytest
import torch

from tests.triton_fixture import start_server

WORDS = ("the quick brown fox jumps over a lazy dog while prefill and decode share one GPU "
         "each on its own partition of streaming multiprocessors").split()


def wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def bullet_server(mps_daemon, tmp_path):
    log = tmp_path / "iterations.jsonl"
    srv = start_server(tmp_path, name="gpu-bullet", overrides={
        "serve.mode": "bullet", "serve.partitioner": "green", "serve.iteration_log": str(log)})
    yield srv, log
    srv.stop()


def test_bullet_server_answers_a_concurrent_load(bullet_server):
    srv, log = bullet_server
    assert len(srv.engine_pids()) == 3, srv.descendants()  # the engine and its two workers
    n = 64

    def one(i: int) -> tuple[int, int, dict]:
        rng = random.Random(1000 + i)
        tokens = rng.randint(16, 96)
        body = {"text_input": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300))),
                "max_tokens": tokens, "min_tokens": tokens, "temperature": 0.8, "seed": i,
                "return_num_output_tokens": True}
        status, out = srv.generate(body)
        return tokens, status, out

    with cf.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(n)))
    bad = [(status, out) for _, status, out in results if status != 200]
    assert not bad, bad[:3]
    assert [int(out["num_output_tokens"]) for _, _, out in results] == [t for t, _, _ in results]

    wait_for(lambda: srv.metric("bullet_requests_finished_total", reason="length") == n,
             what=f"{n} requests counted as finished by length")
    wait_for(lambda: srv.metric("bullet_kv_blocks_used") == 0, what="every KV block back in the pool")
    assert srv.metric("bullet_engine_ready") == 1

    total = torch.cuda.get_device_properties(0).multi_processor_count
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert {r["phase"] for r in records} >= {"prefill", "decode"}
    for r in records:
        assert 0 < r["sms"] <= total, r
        if 0 < r["prefill_sms"] < total:
            assert r["prefill_sms"] + r["decode_sms"] == total, r
