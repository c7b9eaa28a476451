"""Per-request sampling parameters and the batched sampler.

Randomness is counter-based: the noise for (seed, output index, vocab id) comes from a hash,
so a request with a seed draws the same tokens whatever else shares its batch, and on any
device. Sampling uses the Gumbel-max form of categorical sampling: argmax(logit_i / T + G_i),
G_i = -log(-log(u_i)), picks token i with probability softmax(logits / T)_i, with no softmax
computed; the draw is one kernel that streams each row's logits once
(kernels/triton_sample.py; kernels/reference.gumbel_argmax on CPU). Rows with top-k or top-p
find their kept tokens among their 1024 largest logits (`_draw_filtered`); a nucleus that
reaches past them is redrawn over the whole row (on a GPU by kernels/triton_sample.nucleus_tail_draw).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from bullet_trt.kernels import reference
from bullet_trt.kernels.host_to_device import device_tensor

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[list[int]] = field(default_factory=list)  # filled from `stop` by the frontend
    end_id: int | None = None  # None: the checkpoint's EOS ids
    ignore_eos: bool = False
    logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def resolved_seed(self) -> int:
        if self.seed is None:
            self.seed = int.from_bytes(os.urandom(8), "little")
        return self.seed


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's 32-bit noise key, from its seed (int64 bit pattern) and output index."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = reference.fmix32(reference.fmix32(lo ^ 0x9E3779B9) ^ hi)
    return reference.fmix32(key ^ ((steps.long() * 0x632BE5AB) & _MASK32))


@dataclass
class SamplingBatch:
    """Per-row sampling state packed for one step (rows follow the batch order). The
    per-row tensors are None when every row is greedy: argmax needs none of them."""

    temperature: torch.Tensor | None  # float32 (B,)
    top_k: torch.Tensor | None  # int64 (B,)
    top_p: torch.Tensor | None  # float32 (B,)
    seeds: torch.Tensor | None  # int64 (B,) (bit pattern of the uint64 seed)
    steps: torch.Tensor | None  # int64 (B,): index of the token being sampled in the output
    banned: list[list[int]]  # token ids forbidden on this step (EOS before min_tokens)
    all_greedy: bool
    want_logprobs: bool
    drawn: torch.Tensor | None = None  # int64: rows drawn from their whole distribution
    filtered: torch.Tensor | None = None  # int64: rows drawn after top-k / top-p
    widest_top_k: int = 0  # the largest top-k among the filtered rows
    # Whether a filtered row has top-p without top-k: only such a row's nucleus can reach past
    # its candidates, and only then must the step look at the device for it (`_draw_filtered`).
    nucleus_unbounded: bool = False

    @staticmethod
    def build(params: list[SamplingParams], steps: list[int], banned: list[list[int]],
              device: torch.device | str) -> "SamplingBatch":
        all_greedy = all(p.greedy for p in params)
        want_logprobs = any(p.logprobs for p in params)
        if all_greedy:
            return SamplingBatch(None, None, None, None, None, banned, True, want_logprobs)
        seeds = [p.resolved_seed() for p in params]
        seeds = [s - 2**64 if s >= 2**63 else s for s in seeds]
        drawn = [i for i, p in enumerate(params) if not p.greedy and p.top_k == 0 and p.top_p >= 1.0]
        filtered = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
        return SamplingBatch(
            temperature=device_tensor([0.0 if p.greedy else p.temperature for p in params],
                                       torch.float32, device),
            top_k=device_tensor([p.top_k for p in params], torch.int64, device),
            top_p=device_tensor([p.top_p for p in params], torch.float32, device),
            seeds=device_tensor(seeds, torch.int64, device),
            steps=device_tensor(steps, torch.int64, device),
            banned=banned,
            all_greedy=False,
            want_logprobs=want_logprobs,
            drawn=device_tensor(drawn, torch.int64, device) if drawn else None,
            filtered=device_tensor(filtered, torch.int64, device) if filtered else None,
            widest_top_k=max((params[i].top_k for i in filtered), default=0),
            nucleus_unbounded=any(params[i].top_k == 0 for i in filtered),
        )


def sample(logits: torch.Tensor, batch: SamplingBatch, scratch: torch.Tensor | None = None,
           ops=reference) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Picks one token per row of logits (B, V): in float32 where a draw or log-probabilities
    need it, else by the argmax of the logits as they are.

    Returns (token ids int64 (B,), log-probabilities of those tokens under the model's
    unmodified distribution, or None when no row asked for them). `scratch`, a float32
    (rows, V) buffer, takes the float32 copy when it has the rows (`float32_scratch`). `ops`:
    the kernels the draw runs with (the model's: Triton's on a GPU, the torch reference else).
    Banned tokens are masked in `logits` itself when every row is greedy and none wants
    log-probabilities (and in float32 logits always): callers hand over logits they are done with.
    """
    if batch.all_greedy and not batch.want_logprobs:
        # bfloat16 widens to float32 exactly, so the argmax is the same without the float32
        # copy: at 1024 rows of a 128k vocabulary that copy moved ~0.75 GB a decode step
        if any(batch.banned):
            _ban(logits, batch.banned)
        return logits.argmax(dim=-1), None
    if scratch is not None and logits.dtype != torch.float32 and logits.shape[0] <= scratch.shape[0]:
        logits = scratch[:logits.shape[0]].copy_(logits)
    else:
        logits = logits.float()
    if any(batch.banned):
        _ban(logits, batch.banned)
    logprobs = None
    if batch.want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    if not batch.all_greedy:
        keys = row_keys(batch.seeds, batch.steps)
        if batch.drawn is not None:
            d = batch.drawn
            tokens[d] = ops.gumbel_argmax(logits, d, batch.temperature[d].clamp(min=1e-5), keys[d])
        if batch.filtered is not None:
            f = batch.filtered
            rows = logits if f.shape[0] == logits.shape[0] else logits[f]  # every row filtered: no copy
            tokens[f] = _draw_filtered(rows, batch.temperature[f].clamp(min=1e-5), batch.top_k[f],
                                       batch.top_p[f], keys[f], batch.widest_top_k, batch.nucleus_unbounded, ops)
    token_logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1) if logprobs is not None else None
    return tokens, token_logprobs


def _ban(logits: torch.Tensor, banned: list[list[int]]) -> None:
    """Sets each row's banned tokens to -inf: one scatter over all rows when they ban the same
    ids (a fixed-length benchmark's requests ban the end tokens on every row until their
    min_tokens), else one per distinct list. One indexing op per row costs more than the
    step's GEMMs, and listing every (row, token) pair in Python took 1.4-1.8 ms a step at 1024
    rows, the GPU idle meanwhile, against ~0.2 ms here (`bullet-trt bench host-step`).

    No op here waits for the device: `logits[idx] = float("-inf")` did, since indexing
    assignment copies its Python value from pageable host memory, which synchronizes the
    stream. That held the decode worker's launch of a step until the step's graph had run
    (27 ms of a 32 ms step at 512 rows on an H100, `bullet-trt bench decode-overlap`), so a
    step launched one ahead had nothing left to overlap. The fill value lives on the device."""
    first = banned[0]
    if first and all(ids == first for ids in banned):  # every row bans the same: no row index
        logits.index_fill_(1, device_tensor(first, torch.int64, logits.device), float("-inf"))
        return
    rows_by_ids: dict[tuple[int, ...], list[int]] = {}
    for row, ids in enumerate(banned):
        if ids:
            rows_by_ids.setdefault(tuple(ids), []).append(row)
    if not rows_by_ids:
        return
    minus_inf = logits.new_full((), float("-inf"))
    for ids, rows in rows_by_ids.items():
        logits.index_put_((device_tensor(rows, torch.int64, logits.device).unsqueeze(1),
                           device_tensor(list(ids), torch.int64, logits.device)), minus_inf)


def _draw_filtered(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   keys: torch.Tensor, widest_top_k: int, nucleus_unbounded: bool = True,
                   ops=reference) -> torch.Tensor:
    """Tokens drawn from rows of logits (R, V) at their temperatures after top-k, then top-p
    over the top-k survivors (the smallest prefix, by probability, whose mass reaches p). A
    row's kept tokens are found among its `CANDIDATES` largest logits (or its top k, if wider),
    so that R rows of a 128k vocabulary need (R, 1024) tensors rather than a sort of every row;
    a row whose nucleus reaches past them (a flat distribution at a top-p near 1) sorts its
    whole row instead. The draw is the Gumbel-max of the kept tokens under the same hashed
    noise as every other row. (Dividing by a positive temperature keeps the logits' order.)

    Nothing here waits for the device where `ops` has a kernel for the rows whose nucleus
    outgrew the candidates (`nucleus_tail_draw`, Triton's on a GPU): it redraws them in place,
    and a settled row's program returns at once. Without one (the torch reference), which rows
    to sort whole is read on the host, a wait for the step; rows that all have a top-k
    (`nucleus_unbounded` false) are settled by their candidates, which hold their top k, and
    need neither."""
    vocab = logits.shape[1]
    width = min(vocab, max(CANDIDATES, widest_top_k))
    vals, idx = logits.topk(width, dim=-1)  # descending
    temp = temperature.unsqueeze(1)
    scaled = vals / temp
    kept, complete, norm = _kept(logits, temperature, scaled, top_k, top_p, nucleus_unbounded)
    tokens = _gumbel_pick(scaled, idx, kept, keys)
    if not (width < vocab and nucleus_unbounded):
        return tokens
    tail_draw = getattr(ops, "nucleus_tail_draw", None)
    if tail_draw is not None:
        tail_draw(logits, temperature, top_p, keys, norm, scaled[:, -1].contiguous(), complete, tokens)
        return tokens
    if not bool(complete.all()):
        wide = (~complete).nonzero().squeeze(1)
        wide_logits = logits[wide]
        vals, idx = wide_logits.sort(dim=-1, descending=True)
        scaled = vals / temp[wide]
        kept, _, _ = _kept(wide_logits, temperature[wide], scaled, top_k[wide], top_p[wide], True)
        tokens[wide] = _gumbel_pick(scaled, idx, kept, keys[wide])
    return tokens


CANDIDATES = 1024  # an LM's nucleus at a top-p below ~0.95 lies far inside its top 1024


def _kept(logits: torch.Tensor, temperature: torch.Tensor, vals: torch.Tensor, top_k: torch.Tensor,
          top_p: torch.Tensor, nucleus_unbounded: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(which of each row's candidates `vals` (R, W), its largest logits / temperature in
    descending order, it keeps; whether that settles the row: its kept tokens all lie among
    the W; the log-normalizer its top-p weighs by). Without a row of top-p alone
    (`nucleus_unbounded` false) every row's survivors are among the W, and the whole rows'
    normalizer is not computed."""
    width, vocab = vals.shape[1], logits.shape[1]
    survivors = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    in_k = torch.arange(width, device=vals.device).unsqueeze(0) < survivors.unsqueeze(1)
    # top-p weighs the top-k survivors: all of them among the candidates, or the whole row
    # (candidates as wide as the row hold every survivor: no second pass over it)
    norm = torch.logsumexp(vals.masked_fill(~in_k, float("-inf")), dim=-1)
    if width < vocab and nucleus_unbounded:
        whole = torch.cat([(logits[i:i + 16] / temperature[i:i + 16].unsqueeze(1)).logsumexp(dim=-1)
                           for i in range(0, logits.shape[0], 16)])  # 16 rows at a time: no (R, V) temporary
        norm = torch.where(survivors <= width, norm, whole)
    probs = torch.exp(vals - norm.unsqueeze(1)).masked_fill(~in_k, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    kept = in_k & (mass_before < top_p.unsqueeze(1))
    kept[:, 0] = True
    complete = (survivors <= width) | (mass_before[:, -1] + probs[:, -1] >= top_p)
    return kept, complete, norm


def _gumbel_pick(vals: torch.Tensor, idx: torch.Tensor, kept: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The kept candidate with the largest scaled logit plus its vocabulary index's noise."""
    race = (vals.double() + reference.gumbel_noise(keys, idx)).masked_fill(~kept, float("-inf"))
    return idx.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)


def float32_scratch(rows: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """The buffer a GPU session samples its steps' float32 logits in, made once at start.

    Otherwise each step allocates its own (B x V x 4 bytes, half a GiB at 1024 rows of a
    128k vocabulary), of a new size whenever the batch grows. CUDA graph capture empties the
    caching allocator, so after start every new largest batch took a new segment and kept the
    smaller ones cached: an H100's decode worker grew by hundreds of MiB within a run, which the
    prefill worker, another process, could not reclaim, and its steps ran out of memory.
    None on CPU, where host memory is not the limit."""
    if device.type != "cuda":
        return None
    return torch.empty(rows, vocab, dtype=torch.float32, device=device)

