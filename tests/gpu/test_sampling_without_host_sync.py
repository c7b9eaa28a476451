"""Sampling a decode step's tokens queues GPU work and never waits for the device, so that the
decode worker can launch a step while the one before still runs (decode.overlap_steps).

A mask of banned tokens written as `logits[idx] = float("-inf")` copied its Python value from
pageable memory, which synchronized the stream: every launch then waited for its own step's
graph, and the overlapped decode loop was slower than the plain one (`bullet-trt bench
decode-overlap`, 2026-11-27). PyTorch's sync debug mode turns any such wait into an error."""
from __future__ import annotations

import contextlib

import pytest
import torch

from bullet_trt.engine.sampling import SamplingBatch, SamplingParams, _ban, float32_scratch, sample
from bullet_trt.kernels import ops_for

VOCAB = 128256
ROWS = 512
END_IDS = [128001, 128008, 128009]


@contextlib.contextmanager
def no_host_sync():
    """Inside it, an op that makes the host wait for the device raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def logits_on_gpu(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(ROWS, VOCAB, device="cuda", dtype=torch.bfloat16, generator=g)


@pytest.mark.parametrize("banned", [
    [END_IDS] * ROWS,  # a fixed-length benchmark: every row bans the end tokens
    [END_IDS if row % 3 else [] for row in range(ROWS)],
    [[row % 7, 5] if row % 2 else END_IDS for row in range(ROWS)],
], ids=["every-row-the-same", "some-rows", "two-lists"])
def test_the_banned_token_mask_does_not_wait_for_the_device(banned):
    logits = logits_on_gpu(0)
    expected = logits.float().clone()
    for row, ids in enumerate(banned):  # the old way, which waits: outside the check
        expected[row, ids] = float("-inf")
    with no_host_sync():
        _ban(logits, banned)
    assert torch.equal(logits.float(), expected)


KINDS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=100, min_tokens=100),
    "seeded": SamplingParams(temperature=0.8, seed=3, max_tokens=100, min_tokens=100),
    # a top-k bounds the nucleus within the candidates: nothing to check on the host
    "top-k-and-top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3, max_tokens=100, min_tokens=100),
    # a nucleus past the 1024 candidates is redrawn by a kernel on the device (flat random
    # logits at top-p 0.9: every row's is)
    "top-p": SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=100, min_tokens=100),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_step_of_banned_rows_samples_without_waiting(kind):
    params = KINDS[kind]
    logits = logits_on_gpu(1)
    scratch = float32_scratch(ROWS, VOCAB, logits.device)
    with no_host_sync():
        batch = SamplingBatch.build([params] * ROWS, [1] * ROWS, [END_IDS] * ROWS, logits.device)
        tokens, _ = sample(logits, batch, scratch, ops_for(logits.device))
    picked = tokens.tolist()
    assert len(picked) == ROWS and not set(picked) & set(END_IDS)


def test_the_check_catches_the_mask_that_waited():
    """The sync debug mode sees the wait the old mask made, so the tests above can fail."""
    logits = logits_on_gpu(2)
    ids = torch.tensor(END_IDS, device="cuda")
    with pytest.raises(RuntimeError), no_host_sync():
        logits[:, ids] = float("-inf")

