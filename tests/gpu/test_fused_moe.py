"""The Triton fused MoE (bullet_trt.kernels.triton_moe) against the torch reference.

On a GPU with Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of 768, top 8) in fp32 and
bf16, for decode-sized and prefill-sized batches, both tile forms, a rank that holds only a
range of the experts, and inside a captured CUDA graph replayed on new routing; without CUDA
they are skipped, unless TRITON_INTERPRET=1 is set (and Triton installed), in which case they
run in the Triton interpreter on CPU with small shapes. The reference runs in fp32 on upcast
inputs. Error is relative: ||out - ref|| / ||ref||. Speed: `bullet-trt bench moe`.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.numerics import CUDA, kernel_device, rel_err

RUNS_IN_TRITON_INTERPRETER = True  # tests/gpu/conftest.py runs this module on CPU then
DEV = kernel_device()  # skips this module where kernels cannot run

from bullet_trt.kernels import fp8_blocks, moe_tiles  # noqa: E402
from bullet_trt.kernels import reference as ref  # noqa: E402
from bullet_trt.kernels import triton_moe as tmoe  # noqa: E402
from bullet_trt.model.transformer import NO_EXPERT, unrouted_past  # noqa: E402
from bullet_trt.tools.bench.moe_bench import graphed  # noqa: E402

FP32, BF16 = torch.float32, torch.bfloat16
# The interpreter truncates fp32 to bf16 where the GPU rounds: twice the error of one rounding.
TOL = {FP32: 1e-4, BF16: 1e-2 if CUDA else 2e-2}
FP8_ACT_BF16_TOL = 3e-2  # bf16 activations rounded to FP8: see the test
FP8_ACT_FP32_TOL = 1e-2  # on an H200 1.4e-4 to 3.3e-3, by the tiles (2026-11-28): see the test
# (hidden, inter, experts, top k)
LAYER = (2048, 768, 128, 8) if CUDA else (64, 32, 16, 4)
DECODE_TOKENS = (1, 7, 64, 256) if CUDA else (1, 5)
# FP8 experts on CPU: dims past one 128-wide scale block, inter not a multiple of it (the up's
# scale rows start mid-way through what would be a block of the stack)
FP8_LAYER = LAYER if CUDA else (256, 160, 8, 2)
PREFILL_TOKENS = (1000, 4096) if CUDA else (40,)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
    tmoe.MOE_TILE_OVERRIDE = None


def layer(dtype, hidden, inter, experts):
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device=DEV) * hidden ** -0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, device=DEV) * inter ** -0.5).to(dtype)
    router = (torch.randn(experts, hidden, device=DEV) * 2 * hidden ** -0.5).to(dtype)
    return w_gate_up, w_down, router


def routed(tokens, hidden, router, top_k, renormalize=True):
    x = torch.randn(tokens, hidden, device=DEV).to(router.dtype)
    weights, ids = ref.moe_route(x @ router.t(), top_k, renormalize)
    return x, weights, ids


def want(x, w_gate_up, w_down, weights, ids, offset=0):
    return ref.fused_moe(x.float(), w_gate_up.float(), w_down.float(), weights.float(), ids, offset)


def check(got, expected, dtype):
    err = rel_err(got, expected)
    assert err <= TOL[dtype], f"rel_err {err:.3e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("tokens", DECODE_TOKENS + PREFILL_TOKENS)
def test_fused_moe_matches_reference(dtype, tokens):
    hidden, inter, experts, top_k = LAYER
    w_gate_up, w_down, router = layer(dtype, hidden, inter, experts)
    x, weights, ids = routed(tokens, hidden, router, top_k, renormalize=tokens % 2 == 0)
    check(tmoe.fused_moe(x, w_gate_up, w_down, weights, ids), want(x, w_gate_up, w_down, weights, ids), dtype)


def fp8_layer(hidden, inter, experts):
    """An FP8 layer (fp8_blocks) and the bf16 weights its blocks stand for. Rows and columns of
    different sizes give each block its own scale, so a block read with another's shows."""
    w_gate_up, w_down, router = layer(BF16, hidden, inter, experts)
    w_gate_up = (w_gate_up.float() * torch.linspace(0.25, 4.0, 2 * inter, device=DEV)[:, None]).to(BF16)
    w_down = (w_down.float() * torch.linspace(4.0, 0.25, inter, device=DEV)).to(BF16)
    fp8 = fp8_blocks.quantize_experts(w_gate_up, w_down)
    dequantized = (fp8_blocks.dequantize_gate_up(fp8["w_gate_up"], fp8["gate_up_scale"], FP32),
                   fp8_blocks.dequantize(fp8["w_down"], fp8["down_scale"], FP32))
    return fp8, dequantized, router


def fp8_moe(x, fp8, weights, ids):
    return tmoe.fused_moe(x, fp8["w_gate_up"], fp8["w_down"], weights, ids,
                          gate_up_scale=fp8["gate_up_scale"], down_scale=fp8["down_scale"])


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("tokens", DECODE_TOKENS + PREFILL_TOKENS)
def test_fp8_experts_compute_their_dequantized_weights(dtype, tokens):
    """Weights read as FP8 blocks and scaled per block inside the kernel: the reference over
    the weights the blocks stand for (fp32 activations check the scales' indexing tightly)."""
    hidden, inter, experts, top_k = FP8_LAYER
    fp8, (w_gate_up, w_down), router = fp8_layer(hidden, inter, experts)
    x, weights, ids = routed(tokens, hidden, router.to(dtype), top_k)
    check(fp8_moe(x, fp8, weights, ids), want(x, w_gate_up, w_down, weights, ids), dtype)


def tiles_to_check():
    """Both untuned forms and every distinct tile of the tuned tables: whichever one a token
    count picks on whichever GPU computes the same."""
    tiles = {"untuned small": tmoe.MOE_CONFIGS[(False, False)], "untuned large": tmoe.MOE_CONFIGS[(False, True)]}
    for path in sorted(moe_tiles.TABLES_DIR.glob("*.json")):
        for tokens, tile in moe_tiles.parse_table(json.loads(path.read_text()), path.name):
            tiles.setdefault(str(sorted(tile.items())), tile)
    return list(tiles.values())


@pytest.mark.parametrize("tile", tiles_to_check(), ids=lambda t: "m{BLOCK_M}n{BLOCK_N}k{BLOCK_K}g{GROUP_M}w{num_warps}s{num_stages}".format(**t))
def test_every_tile_matches_reference(tile):
    hidden, inter, experts, top_k = LAYER
    w_gate_up, w_down, router = layer(BF16, hidden, inter, experts)
    x, weights, ids = routed(DECODE_TOKENS[-1], hidden, router, top_k)
    tmoe.MOE_TILE_OVERRIDE = tile
    check(tmoe.fused_moe(x, w_gate_up, w_down, weights, ids), want(x, w_gate_up, w_down, weights, ids), BF16)


def test_without_a_table_fp8_activations_take_k_steps_of_one_scale_group():
    """Large batches of FP8 activations step K by one 128-wide scale group: the bf16 large
    form's 64 ran 2.6-3.7x slower on an H200 (a GPU without a table runs the untuned forms)."""
    small, large = tmoe.untuned_forms(BF16, fp8_activations=True)
    assert large["BLOCK_K"] == fp8_blocks.BLOCK and small == tmoe.untuned_forms(BF16)[0]
    assert tmoe.untuned_config(BF16, 4096, 8, 128, fp8_activations=True) == large  # a prefill of Qwen3-30B-A3B


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("tokens", DECODE_TOKENS + PREFILL_TOKENS)
def test_fp8_activations_compute_their_rounded_inputs(dtype, tokens):
    """quantization=fp8-w8a8: x and each assignment's silu(gate) * up rounded to FP8 per token
    and 128 columns, both operands of the products FP8: the reference over the same rounding."""
    hidden, inter, experts, top_k = FP8_LAYER
    fp8, (w_gate_up, w_down), router = fp8_layer(hidden, inter, experts)
    x, weights, ids = routed(tokens, hidden, router.to(dtype), top_k)
    got = tmoe.fused_moe(x, fp8["w_gate_up"], fp8["w_down"], weights, ids, gate_up_scale=fp8["gate_up_scale"],
                         down_scale=fp8["down_scale"], fp8_activations=True)
    expected = ref.fused_moe(x.float(), fp8["w_gate_up"], fp8["w_down"], weights.float(), ids,
                             gate_up_scale=fp8["gate_up_scale"], down_scale=fp8["down_scale"], fp8_activations=True)
    # the kernel's silu(gate) * up differs from the reference's in its last bits (bf16: rounded
    # to bf16 first; fp32: the FP8 products' accumulation, whose order the tile sets), so a few
    # values land on the other side of an FP8 step when rounded again: ~1e-3 of them, each off
    # by a step of 6-12%, a relative error of ~3e-3
    tol = FP8_ACT_FP32_TOL if dtype == FP32 else FP8_ACT_BF16_TOL
    assert rel_err(got, expected) <= tol
    assert rel_err(expected, want(x, w_gate_up, w_down, weights, ids)) > 3 * FP8_ACT_FP32_TOL  # the rounding is there (~4%)


@pytest.mark.skipif(not CUDA, reason="the interpreter rounds fp32 to FP8 wrongly near powers of two")
def test_activation_groups_quantize_on_the_device_as_torch_does():
    x = (torch.randn(300, 200, device=DEV) * torch.linspace(0.1, 5.0, 200, device=DEV)).to(BF16)
    q, scale = tmoe.quantize_token_groups(x)
    want_q, want_scale = fp8_blocks.quantize_token_groups(x)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


SWAPPED = [{**tmoe.MOE_CONFIGS[(False, large)], moe_tiles.SWAP_AB: 1} for large in (False, True)]


@pytest.mark.parametrize("tile", SWAPPED, ids=["small", "large"])
def test_the_swapped_product_computes_the_same(tile):
    """SWAP_AB (C^T = B A^T) for bf16 weights, at decode's and prefill's token counts."""
    hidden, inter, experts, top_k = LAYER
    w_gate_up, w_down, router = layer(BF16, hidden, inter, experts)
    tmoe.MOE_TILE_OVERRIDE = tile
    for tokens in (DECODE_TOKENS[-1], PREFILL_TOKENS[0]):
        x, weights, ids = routed(tokens, hidden, router, top_k)
        check(tmoe.fused_moe(x, w_gate_up, w_down, weights, ids), want(x, w_gate_up, w_down, weights, ids), BF16)


@pytest.mark.parametrize("tile", tiles_to_check() + SWAPPED,
                         ids=lambda t: "m{BLOCK_M}n{BLOCK_N}k{BLOCK_K}g{GROUP_M}w{num_warps}s{num_stages}".format(**t)
                         + ("-swapped" if t.get(moe_tiles.SWAP_AB) else ""))
def test_every_tile_computes_fp8_experts(tile):
    hidden, inter, experts, top_k = FP8_LAYER
    fp8, (w_gate_up, w_down), router = fp8_layer(hidden, inter, experts)
    x, weights, ids = routed(DECODE_TOKENS[-1], hidden, router, top_k)
    tmoe.MOE_TILE_OVERRIDE = tile
    check(fp8_moe(x, fp8, weights, ids), want(x, w_gate_up, w_down, weights, ids), BF16)


def test_a_rank_holding_an_expert_range_computes_its_share():
    """Expert parallelism's seam: ranks holding disjoint expert ranges sum to the whole."""
    hidden, inter, experts, top_k = LAYER
    w_gate_up, w_down, router = layer(FP32, hidden, inter, experts)
    x, weights, ids = routed(DECODE_TOKENS[-1], hidden, router, top_k)
    cuts = [0, experts // 3, experts // 2 + 1, experts]
    parts = []
    for lo, hi in zip(cuts, cuts[1:]):
        got = tmoe.fused_moe(x, w_gate_up[lo:hi], w_down[lo:hi], weights, ids, expert_offset=lo)
        check(got, want(x, w_gate_up[lo:hi], w_down[lo:hi], weights, ids, lo), FP32)
        parts.append(got)
    check(sum(parts), want(x, w_gate_up, w_down, weights, ids), FP32)


def test_padded_rows_sent_to_no_expert_come_out_zero_and_leave_the_real_rows_alone():
    """A piecewise step's padded rows (model/transformer.unrouted_past): their assignments are
    left out of the sort, so they cost the grouped GEMM nothing, and they read zero."""
    hidden, inter, experts, top_k = LAYER
    w_gate_up, w_down, router = layer(FP32, hidden, inter, experts)
    tokens = DECODE_TOKENS[-1] + 3
    x, weights, ids = routed(tokens, hidden, router, top_k)
    real = tokens - 3
    unrouted = unrouted_past(ids, torch.tensor([real], device=DEV))
    assert bool((unrouted[real:] == NO_EXPERT).all()) and torch.equal(unrouted[:real], ids[:real])
    got = tmoe.fused_moe(x, w_gate_up, w_down, weights, unrouted)
    assert torch.count_nonzero(got[real:]) == 0
    check(got[:real], want(x[:real], w_gate_up, w_down, weights[:real], ids[:real]), FP32)
    _, _, num_padded = tmoe.moe_align_block_size(unrouted, 16, experts)
    _, _, all_padded = tmoe.moe_align_block_size(ids, 16, experts)
    assert int(num_padded.item()) <= int(all_padded.item())


def test_align_block_size_groups_each_expert_in_whole_blocks():
    _, _, experts, top_k = LAYER
    tokens, block_m, offset, local = 37, 16, 3, experts // 2
    ids = torch.stack([torch.randperm(experts, device=DEV)[:top_k] for _ in range(tokens)]).to(torch.int32)
    sorted_ids, block_expert, num_padded = tmoe.moe_align_block_size(ids, block_m, local, offset)
    n = tokens * top_k
    assert sorted_ids.numel() >= n + local * (block_m - 1) and sorted_ids.numel() % block_m == 0
    assert block_expert.numel() == sorted_ids.numel() // block_m
    flat = ids.reshape(-1).long().cpu() - offset
    mine = ((flat >= 0) & (flat < local)).nonzero().flatten()
    used = int(num_padded.item())
    body = sorted_ids[:used].long().cpu()
    assert sorted(body[body < n].tolist()) == mine.tolist()  # each local assignment once
    assert bool((sorted_ids[used:] == n).all())  # nothing past the padded length
    blocks = body.view(-1, block_m)
    experts_of_blocks = block_expert[:used // block_m].long().cpu()
    for row, e in zip(blocks, experts_of_blocks):
        real = row[row < n]
        assert real.numel() > 0 and bool((flat[real] == e).all())  # one expert per block
    assert experts_of_blocks.tolist() == sorted(experts_of_blocks.tolist())


def captured(step):
    """`step` captured in a CUDA graph as the MoE bench captures (tools/bench/moe_bench.graphed):
    the replay and the output tensor each replay writes (the captured call's, the last one)."""
    outs = []
    replay = graphed(lambda: outs.append(step()))
    return replay, outs[-1]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("tokens", [1, 64])
def test_fused_moe_inside_a_cuda_graph_follows_new_routing(tokens):
    """Captured once (no host sync is allowed during capture), replayed on inputs routed to
    other experts: the sorted buffers sized for the worst case fit any routing."""
    hidden, inter, experts, top_k = LAYER
    w_gate_up, w_down, router = layer(BF16, hidden, inter, experts)
    x = torch.zeros(tokens, hidden, dtype=BF16, device=DEV)

    def step():
        weights, ids = tmoe.moe_route(x @ router.t(), top_k, True)
        return tmoe.fused_moe(x, w_gate_up, w_down, weights, ids)

    x.copy_(torch.randn_like(x))
    replay, out = captured(step)
    seen = set()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        replay()
        torch.cuda.synchronize()
        weights, ids = ref.moe_route(x @ router.t(), top_k, True)
        seen.add(tuple(ids.flatten().tolist()))
        check(out, want(x, w_gate_up, w_down, weights, ids), BF16)
    assert len(seen) == 3  # every replay routed differently


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_fp8_experts_inside_a_cuda_graph_follow_new_routing():
    hidden, inter, experts, top_k = FP8_LAYER
    fp8, (w_gate_up, w_down), router = fp8_layer(hidden, inter, experts)
    x = torch.zeros(64, hidden, dtype=BF16, device=DEV)

    def step():
        weights, ids = tmoe.moe_route(x @ router.t(), top_k, True)
        return fp8_moe(x, fp8, weights, ids)

    x.copy_(torch.randn_like(x))
    replay, out = captured(step)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        replay()
        torch.cuda.synchronize()
        weights, ids = ref.moe_route(x @ router.t(), top_k, True)
        check(out, want(x, w_gate_up, w_down, weights, ids), BF16)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_a_captured_layer_reads_the_real_row_count_at_each_replay():
    """The piecewise graphs' padded rows (model/transformer.unrouted_past): captured once, the
    count lives on the device, so each replay leaves out the rows past its own count."""
    hidden, inter, experts, top_k = LAYER
    w_gate_up, w_down, router = layer(BF16, hidden, inter, experts)
    tokens = 64
    x = torch.randn(tokens, hidden, dtype=BF16, device=DEV)
    real_rows = torch.full((1,), tokens, dtype=torch.long, device=DEV)

    def step():
        weights, ids = tmoe.moe_route(x @ router.t(), top_k, True)
        return tmoe.fused_moe(x, w_gate_up, w_down, weights, unrouted_past(ids, real_rows))

    replay, out = captured(step)
    for real in (40, 7, 64):
        real_rows.fill_(real)
        replay()
        torch.cuda.synchronize()
        weights, ids = ref.moe_route(x @ router.t(), top_k, True)
        assert torch.count_nonzero(out[real:]) == 0
        check(out[:real], want(x[:real], w_gate_up, w_down, weights[:real], ids[:real]), BF16)
