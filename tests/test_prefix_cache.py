"""Automatic prefix caching (kv.prefix_caching): the allocator that keeps computed prompt blocks,
and the engines in chunked and bullet mode giving the tokens they give without it while later
prompts take the blocks of earlier ones."""
import pytest

from bullet_trt.config import ConfigError
from bullet_trt.engine.block_allocator import BlockAllocator
from bullet_trt.engine.prefix_cache import PrefixCachingAllocator, admit
from bullet_trt.engine.sampling import SamplingParams
from bullet_trt.engine.sequence import Sequence
from bullet_trt.serving.llm import LLM
from tests.test_engine import engine_dir_for, prompts

BS = 4


def cache(blocks: int = 8) -> PrefixCachingAllocator:
    return PrefixCachingAllocator(BlockAllocator(blocks), BS)


def computed(alloc: PrefixCachingAllocator, prompt: list[int]) -> list[int]:
    """A sequence's block table after its whole prompt ran, as the engines leave it."""
    table = alloc.match_prefix(prompt)
    assert alloc.grow(table, len(prompt), BS)
    alloc.register_prefix(prompt, table, len(prompt))
    return table


def test_a_prompt_takes_the_blocks_an_earlier_one_left_and_computes_its_last_token():
    alloc = cache()
    first = list(range(10))
    table = computed(alloc, first)  # blocks of tokens 0-3, 4-7, and 8-9 (not full: not kept)
    alloc.release(list(table))
    assert alloc.num_free == 8 and alloc.num_cached == 2
    again = alloc.match_prefix(first)
    assert again == table[:2] and alloc.num_cached == 0
    assert alloc.match_prefix(list(range(8))) == table[:1]  # its last token stays to compute
    assert alloc.match_prefix([0, 1, 2, 3, 9, 9, 9, 9, 9]) == table[:1]  # the second block differs
    assert alloc.match_prefix([9] + list(range(1, 10))) == []


def test_a_sequence_takes_its_prefix_with_the_rest_of_its_blocks_or_not_at_all():
    alloc = cache(6)
    head = list(range(12))
    alloc.release(computed(alloc, head + [1]))  # three kept blocks, three free
    whole = lambda s: s.num_tokens  # noqa: E731  (its whole prefill, as bullet asks)
    long = Sequence("long", head + [5] * 20, SamplingParams())  # 8 blocks: 3 cached + 5 more than there are
    assert not admit(alloc, long, BS, whole)
    assert (long.block_table, long.num_cached_tokens) == ([], 0)  # waits holding nothing
    assert alloc.num_cached == 3 and (alloc.hit_tokens, alloc.prompt_tokens) == (0, 0)
    short = Sequence("short", head + [7] * 4, SamplingParams())
    assert admit(alloc, short, BS, whole)
    assert short.num_cached_tokens == 12 and len(short.block_table) == 4 and alloc.num_cached == 0
    assert (alloc.hit_tokens, alloc.prompt_tokens) == (12, 16)
    assert not admit(BlockAllocator(2), Sequence("x", [1] * 9, SamplingParams()), BS, whole)  # no cache: the pool alone


def test_idle_blocks_go_back_on_demand_oldest_first_with_the_blocks_after_them():
    alloc = cache(6)
    a = computed(alloc, list(range(9)))  # two kept blocks, a chain
    b = computed(alloc, [50 + t for t in range(5)])  # one kept block
    alloc.release(list(a))
    alloc.release(list(b))
    assert alloc.num_free == 6 and alloc.num_cached == 3
    taken = alloc.allocate(4)  # 3 free, then the oldest idle block: a's first, and its child with it
    assert alloc.num_cached == 1 and alloc.pool.num_free == 1
    assert alloc.match_prefix(list(range(9))) == []
    # the evicted blocks hold new tokens now: the old chain must not come back through them
    alloc.register_prefix([7] * 8 + [1], taken[:3], 9)
    alloc.release(list(taken))
    assert alloc.match_prefix(list(range(9))) == [] and alloc.match_prefix([7] * 8 + [1]) == taken[:2]
    assert alloc.match_prefix([50 + t for t in range(5)]) == b[:1]


def test_shared_blocks_are_held_until_every_holder_lets_go():
    alloc = cache()
    prompt = list(range(12))
    first = computed(alloc, prompt)
    second = computed(alloc, prompt)
    assert second[:2] == first[:2] and second[2] != first[2]  # takes the two it may (not the last token's)
    assert alloc.returned_by([first]) == 1  # its third block; the second holds the first two too
    assert alloc.returned_by([first, second]) == 4
    alloc.release(list(first))
    assert alloc.num_cached == 1  # the first's third block; the second holds the other two
    alloc.release(list(second))
    assert alloc.num_free == 8 and alloc.num_cached == 3
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free([first[2]])


def test_two_sequences_that_computed_the_same_prompt_keep_one_copy():
    alloc = cache()
    prompt = list(range(8)) + [1]
    tables = [alloc.match_prefix(prompt) for _ in range(2)]  # both arrive before either ran
    for table in tables:
        assert table == [] and alloc.grow(table, len(prompt), BS)
        alloc.register_prefix(prompt, table, len(prompt))
    for table in tables:
        alloc.release(table)
    assert alloc.num_free == 8 and alloc.num_cached == 2


def test_blocks_of_a_prompt_not_yet_computed_are_not_kept():
    alloc = cache()
    prompt = list(range(12))
    table = alloc.match_prefix(prompt)
    alloc.grow(table, len(prompt), BS)
    alloc.register_prefix(prompt, table, 5)  # a first chunk of 5 tokens: one block complete
    first = table[0]
    alloc.release(table)
    assert alloc.num_cached == 1 and alloc.match_prefix(prompt) == [first]


SHARED = prompts(1, seed=41)[0] * 3  # a long prefix every request below starts with


def requests(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    tails = prompts(4, seed=seed)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)] * 2
    return [SHARED[:40 + 7 * i] + tail for i, tail in enumerate(tails)], params


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return engine_dir_for(tmp_path_factory, "llama")[0]


def run(engine, **overrides):
    """Two waves: the second's prompts find the first's blocks."""
    out = []
    with LLM(str(engine), **overrides) as llm:
        for seed in (3, 4):
            batch, params = requests(seed)
            out += [c.token_ids for c in llm.generate_token_ids(batch, params)]
        stats = llm.engine.stats()
    return out, stats


# chunked with its steps launched one ahead keeps a step's prompt blocks when that step reports
LOOPS = {"chunked": {"serve.mode": "chunked"}, "chunked-ahead": {"serve.mode": "chunked", "decode.overlap_steps": True},
         "bullet": {"serve.mode": "bullet"}}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_the_engines_give_the_same_tokens_with_cached_prefixes(engine, loop):
    common = {**LOOPS[loop], "kv.block_size": 8}
    want, _ = run(engine, **common)
    got, stats = run(engine, **common, **{"kv.prefix_caching": True})
    assert got == want
    assert stats.prefix_cache_hit_tokens >= 4 * 40  # the second wave at least found the shared 40 tokens
    assert stats.kv_blocks_cached > 0 and stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("loop", list(LOOPS))
def test_preempted_sequences_take_their_prefix_back(engine, loop):
    """A pool too small for every sequence at once: the newest are preempted, and recomputed
    from the blocks they had kept."""
    common = {**LOOPS[loop], "kv.block_size": 8, "kv.num_blocks": 32}
    want, _ = run(engine, **common)
    got, stats = run(engine, **common, **{"kv.prefix_caching": True})
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert got == want and stats.kv_blocks_free == stats.kv_blocks_total


def test_prefix_caching_under_tensor_parallelism_is_refused_by_name(engine):
    with pytest.raises(ConfigError, match="kv.prefix_caching is not yet built for tensor parallelism"):
        LLM(str(engine), **{"kv.prefix_caching": True, "parallel.tensor_parallel_size": 2})
