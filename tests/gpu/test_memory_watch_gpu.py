"""The workers' GPU memory on a real allocator: a step that leaves a new segment reserved is
reported, with the device's free memory; decode steps served from graphs reserve nothing as
their batch grows."""
from __future__ import annotations

import torch

from bullet_trt.engine.memory_watch import ReservedMemoryWatch
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.session import BatchItem


def test_reports_a_new_allocator_segment():
    gpu = torch.device("cuda")
    torch.cuda.empty_cache()  # a cached free segment from earlier tests would absorb the allocation
    watch = ReservedMemoryWatch.for_device("prefill", gpu)
    assert watch is not None and "of GPU memory at start; the device has" in watch.started()
    held = torch.empty(512 * 2**20, dtype=torch.uint8, device=gpu)
    line = watch.after_step([BatchItem("r0", [0] * 2048, 0, [0], SamplingParams(), True)])
    assert line is not None and "grew by 512 MiB" in line and "GiB free" in line
    del held


def test_graphed_decode_steps_of_a_growing_batch_reserve_nothing_new(checkpoint, tmp_path):
    """A loaded server's decode batch grows a row or a few at a time. Replayed from CUDA graphs
    and sampled without a float32 copy of their own (greedy rows take the argmax of the graphs'
    logits; others the session's float32 buffer), its steps leave the allocator's reserve as it
    was: before, each step's float32 copy of the logits (B x 128256 x 4 bytes) took a new
    segment whenever the batch grew, and an H200's decode worker grew from 5.8 to 17 GiB in a
    run (docs/benchmarks.md, seventh round of 2026-11-26)."""
    from bullet_trt import LLM
    from bullet_trt.tools.build import build_from_checkpoint

    engine = build_from_checkpoint(checkpoint("llama-large-vocab"), tmp_path / "engine", max_model_len=256,
                                   dtype="bfloat16")
    greedy = SamplingParams(temperature=0.0)
    with LLM(str(engine), **{"serve.mode": "chunked", "kv.num_blocks": 256,
                             "decode.cuda_graph_batch_sizes": [16, 32, 64, 128, 256]}) as llm:
        session = llm.engine.session
        assert session.graphs is not None and session.sample_scratch is not None

        def decode_step(rows: int) -> None:
            session.run([BatchItem(f"r{i}", [1], 3, [i % 256], greedy, True) for i in range(rows)])

        decode_step(1)
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        for rows in range(2, 257, 3):
            decode_step(rows)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - before
    # the sampler's argmax and the banned-token scatter are kilobytes; one float32 copy of
    # 256 rows' logits would be 125 MiB
    assert grown < 8 * 2**20, f"{grown / 2**20:.0f} MiB reserved by decode steps"



def test_blocks_cached_per_stream_go_back_between_steps():
    """The caching allocator keeps a freed block for the stream it was made on: a step of the
    same size on each of six streams (a worker's SM splits) leaves six blocks reserved. Released
    between steps once the idle cache passes the limit, they stay within it."""
    from bullet_trt.engine.idle_cache import IdleCacheRelease

    gpu = torch.device("cuda")
    block = 128 * 2**20
    streams = [torch.cuda.Stream(device=gpu) for _ in range(6)]

    def steps(release: IdleCacheRelease | None) -> int:
        torch.cuda.synchronize(gpu)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(gpu)
        for stream in streams:
            with torch.cuda.stream(stream):
                activations = torch.empty(block, dtype=torch.uint8, device=gpu)
                activations.fill_(1)
                del activations
            stream.synchronize()
            if release is not None:
                release.after_step()
        return torch.cuda.memory_reserved(gpu) - before

    assert steps(None) >= 6 * block  # one block cached per stream
    torch.cuda.empty_cache()  # the release counts from the idle cache it starts with
    release = IdleCacheRelease.for_device("prefill", gpu)
    assert release is not None
    release.limit_bytes = 2 * block
    assert steps(release) <= 2 * block
    assert release.releases >= 2


ROWS, VOCAB = 512, 128256  # a loaded decode batch of Llama 3's vocabulary


def sampled_with_peak(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, int]:
    """(the tokens a GPU session's sampler picks from logits, the most memory the sampling
    allocated beyond what was allocated before it)."""
    from bullet_trt.engine.sampling import SamplingBatch, float32_scratch, sample
    from bullet_trt.kernels import triton_ops

    gpu = logits.device
    scratch = float32_scratch(logits.shape[0], logits.shape[1], gpu)
    batch = SamplingBatch.build(params, [0] * len(params), [[]] * len(params), gpu)
    torch.cuda.synchronize(gpu)
    torch.cuda.reset_peak_memory_stats(gpu)
    before = torch.cuda.memory_allocated(gpu)
    tokens, _ = sample(logits, batch, scratch, triton_ops)
    torch.cuda.synchronize(gpu)
    return tokens, torch.cuda.max_memory_allocated(gpu) - before


def test_a_drawn_batch_needs_no_vocabulary_sized_temporaries():
    """Temperature sampling of 512 rows of Llama 3's vocabulary: the draw streams the logits
    once in a kernel, so the step allocates kilobytes beyond its logits, where the hashed noise
    in torch held several int64 (rows, vocab) tensors, 525 MB each."""
    logits = torch.randn(ROWS, VOCAB, dtype=torch.bfloat16, device="cuda")
    tokens, extra = sampled_with_peak(logits, [SamplingParams(temperature=0.8, seed=i) for i in range(ROWS)])
    assert extra < 16 * 2**20, f"{extra / 2**20:.0f} MiB beyond the logits"
    assert tokens.shape == (ROWS,) and len(set(tokens.tolist())) > ROWS // 2  # draws, not one argmax


def test_a_top_p_batch_finds_its_nucleus_without_sorting_every_row():
    """512 rows at top-p 0.9 whose mass sits in 20 tokens (as a language model's does): the kept
    tokens come from each row's 1024 largest logits, (512, 1024) tensors, where sorting every
    row of a 128k vocabulary took gigabytes."""
    logits = torch.randn(ROWS, VOCAB, device="cuda")
    logits[:, :20] += 15.0
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(ROWS)]
    tokens, extra = sampled_with_peak(logits.to(torch.bfloat16), params)
    assert extra < 96 * 2**20, f"{extra / 2**20:.0f} MiB beyond the logits"
    assert (tokens < 20).all() and len(set(tokens.tolist())) > 5  # inside each nucleus, and drawn
