"""Workloads for the serving benchmark: request lengths, arrival times and prompts.

A workload is a list of :class:`BenchRequest` (arrival time, prompt, input and output token
counts). Lengths come from one of the synthetic distributions below or from a trace file;
arrival times come from a Poisson process at the requested rate (or from the trace).

Synthetic length distributions
------------------------------
Every synthetic dataset draws input and output lengths independently from lognormal
distributions, ``length = round(exp(N(mu, sigma)))``, then clips them (see
:func:`sample_lengths`). For a lognormal, ``median = exp(mu)`` and
``mean = exp(mu + sigma**2 / 2)``. The parameters are APPROXIMATIONS of statistics that papers
report for these datasets, not the datasets themselves:

============  ======  =====  ======  ======  ==============================================
dataset       side    mu     sigma   median  mean (before clipping) and the figure it targets
============  ======  =====  ======  ======  ==============================================
sharegpt      input   4.58   1.00    98      161   (ShareGPT, vLLM paper: mean input 161)
sharegpt      output  5.42   0.90    226     339   (ShareGPT, vLLM paper: mean output 338)
azure-conv    input   6.73   0.80    837     1153  (Azure trace 2023 conversation: ~1000 in)
azure-conv    output  5.02   0.90    151     227   (conversation: ~100-250 out)
azure-code    input   7.40   0.65    1636    2021  (Azure trace 2023 code: ~2000 in)
azure-code    output  3.01   0.85    20      29    (code: ~20-30 out)
============  ======  =====  ======  ======  ==============================================

Clipping: inputs to ``[min_input, max_input]``, outputs to ``[min_output, max_output]``, and
then, so that every request fits the model, ``input + output <= max_model_len`` (the input
is shortened first, never below ``min_input``; then the output). Clipping lowers the means,
notably with a small ``max_model_len``: :func:`describe` reports what a sample really holds.

Trace files
-----------
CSV with a header naming the columns ``arrival_time_s,input_tokens,output_tokens`` (other
columns are ignored; order is free). Arrival times are seconds from the start (any origin:
they are shifted so the first request arrives at 0), non-decreasing.

Prompts
-------
A prompt is a sequence of whole-word vocabulary tokens (`` the`` `` cat`` ...) picked at random,
so different requests share no prefix; with ``shared_prefix_tokens`` every prompt starts with the
same words for that many tokens (or all but its last, for a shorter prompt), as prompts that share
a system prompt do, the rest random as before (what kv.prefix_caching can find). With the engine's tokenizer the text is adjusted until
it encodes (with the BOS token the server adds) to exactly the wanted number of tokens, which
``num_input_tokens`` in the server's response confirms. Without a tokenizer, the prompt is
``n`` common English words, which real BPE tokenizers turn into about ``n`` tokens.
"""
from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    """Lognormal token-count distribution: ``round(exp(N(mu, sigma)))``."""

    mu: float
    sigma: float

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    @property
    def mean(self) -> float:
        return math.exp(self.mu + self.sigma ** 2 / 2)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.rint(rng.lognormal(self.mu, self.sigma, size=n)).astype(np.int64)


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    input: LengthDist
    output: LengthDist
    source: str
    min_input: int = 4
    max_input: int = 8192
    min_output: int = 1
    max_output: int = 2048


def _lognormal_for(mean: float, sigma: float) -> LengthDist:
    """The lognormal with this mean and sigma (mu = ln(mean) - sigma^2 / 2)."""
    return LengthDist(round(math.log(mean) - sigma ** 2 / 2, 2), sigma)


DATASETS: dict[str, DatasetSpec] = {
    "sharegpt": DatasetSpec(
        "sharegpt", _lognormal_for(161, 1.0), _lognormal_for(338, 0.9),
        "ShareGPT-like: means 161 in / 338 out as reported for ShareGPT in the vLLM paper "
        "(Kwon et al., SOSP'23); lognormal shapes chosen by us (heavy tail, median < mean).",
        min_input=4, max_input=4096, min_output=4, max_output=2048),
    "azure-conv": DatasetSpec(
        "azure-conv", _lognormal_for(1155, 0.8), _lognormal_for(227, 0.9),
        "Azure-LLM-inference-trace-2023-like, conversation: ~1000 input / ~100-250 output tokens "
        "(shapes reported for the trace, e.g. Splitwise, ISCA'24); an approximation, not the trace.",
        min_input=16, max_input=8192, min_output=4, max_output=2048),
    "azure-code": DatasetSpec(
        "azure-code", _lognormal_for(2024, 0.65), _lognormal_for(29, 0.85),
        "Azure-LLM-inference-trace-2023-like, code: ~2000 input / ~20-30 output tokens "
        "(shapes reported for the trace); an approximation, not the trace.",
        min_input=16, max_input=8192, min_output=2, max_output=1024),
}


@dataclass
class BenchRequest:
    """One request of a workload."""

    index: int
    arrival_s: float  # seconds after the start of the run
    input_tokens: int  # wanted prompt length (tokens, BOS included)
    output_tokens: int  # max_tokens (and min_tokens, so exactly this many are generated)
    prompt: str = ""
    prompt_tokens: int | None = None  # measured with the tokenizer, when one was given
    prompt_ids: list[int] | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("prompt")
        d.pop("prompt_ids")
        return d


class TraceError(ValueError):
    """A trace file is malformed; the message names the file, line and column."""


TRACE_COLUMNS = ("arrival_time_s", "input_tokens", "output_tokens")


# -- lengths ------------------------------------------------------------------------------------

def clip_lengths(inputs: np.ndarray, outputs: np.ndarray, spec: DatasetSpec | None = None,
                 max_model_len: int | None = None, max_output_tokens: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Clips to the dataset's bounds, to ``max_output_tokens`` and to ``max_model_len``."""
    inputs = np.asarray(inputs, dtype=np.int64).copy()
    outputs = np.asarray(outputs, dtype=np.int64).copy()
    min_in = spec.min_input if spec else 1
    if spec is not None:
        inputs = np.clip(inputs, spec.min_input, spec.max_input)
        outputs = np.clip(outputs, spec.min_output, spec.max_output)
    inputs = np.maximum(inputs, 1)
    outputs = np.maximum(outputs, 1)
    if max_output_tokens:
        outputs = np.minimum(outputs, max_output_tokens)
    if max_model_len:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        min_in = min(min_in, max_model_len - 1)
        inputs = np.minimum(inputs, max_model_len - 1)
        # shorten the input first (not below min_input), then the output
        inputs = np.minimum(inputs, np.maximum(max_model_len - outputs, min_in))
        outputs = np.minimum(outputs, max_model_len - inputs)
        outputs = np.maximum(outputs, 1)
    return inputs, outputs


def sample_lengths(spec: DatasetSpec | str, n: int, seed: int = 0, max_model_len: int | None = None,
                   max_output_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(input lengths, output lengths) of ``n`` requests; the same seed gives the same lengths."""
    spec = get_spec(spec)
    rng = np.random.default_rng([seed, 1])
    inputs = spec.input.sample(rng, n)
    outputs = spec.output.sample(rng, n)
    return clip_lengths(inputs, outputs, spec, max_model_len, max_output_tokens)


def get_spec(spec: DatasetSpec | str) -> DatasetSpec:
    if isinstance(spec, DatasetSpec):
        return spec
    if spec not in DATASETS:
        raise ValueError(f"unknown dataset {spec!r}; known: {', '.join(DATASETS)} or trace:<file.csv>")
    return DATASETS[spec]


def describe(inputs: Sequence[int], outputs: Sequence[int]) -> dict:
    """Mean / median / p90 / min / max of a sample of lengths."""
    out = {}
    for name, values in (("input", inputs), ("output", outputs)):
        a = np.asarray(values, dtype=float)
        out[name] = {"mean": float(a.mean()) if a.size else 0.0,
                     "median": float(np.median(a)) if a.size else 0.0,
                     "p90": float(np.percentile(a, 90)) if a.size else 0.0,
                     "min": int(a.min()) if a.size else 0, "max": int(a.max()) if a.size else 0}
    return out


# -- arrivals -----------------------------------------------------------------------------------

def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of a Poisson process at ``rate`` req/s; the first request at 0.

    The gaps are unit exponentials divided by the rate, so one seed gives the same sequence
    of requests at every rate, only compressed in time: sweeps compare like with like.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 req/s, got {rate}")
    if n <= 0:
        return np.zeros(0)
    gaps = np.random.default_rng([seed, 2]).exponential(1.0, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)]) / rate


def count_for_duration(duration_s: float, rate: float, seed: int = 0, cap: int = 1_000_000) -> int:
    """How many requests of :func:`poisson_arrivals` arrive within ``duration_s`` (at least 1)."""
    n = max(int(duration_s * rate * 1.5) + 16, 16)
    while True:
        t = poisson_arrivals(min(n, cap), rate, seed)
        if t[-1] > duration_s or n >= cap:
            return max(1, int(np.searchsorted(t, duration_s, side="right")))
        n *= 2


# -- trace files --------------------------------------------------------------------------------

@dataclass
class TraceRow:
    arrival_s: float
    input_tokens: int
    output_tokens: int


def read_trace(path: str | Path) -> list[TraceRow]:
    """Reads a trace CSV (header required: arrival_time_s,input_tokens,output_tokens).

    Raises :class:`TraceError` naming the file, the line and the column of the first problem.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: trace file not found")
    rows: list[TraceRow] = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = None
        for header in reader:
            if any(cell.strip() for cell in header) and not header[0].lstrip().startswith("#"):
                break
        else:
            header = None
        if header is None:
            raise TraceError(f"{path}: empty file; expected a header line "
                             f"'{','.join(TRACE_COLUMNS)}'")
        names = [h.strip().lower() for h in header]
        missing = [c for c in TRACE_COLUMNS if c not in names]
        if missing:
            raise TraceError(f"{path}:{reader.line_num}: header lacks column(s) {', '.join(missing)}; "
                             f"expected a header line '{','.join(TRACE_COLUMNS)}', got {','.join(header)!r}")
        col = {c: names.index(c) for c in TRACE_COLUMNS}
        last = None
        for cells in reader:
            line = reader.line_num
            if not any(c.strip() for c in cells) or cells[0].lstrip().startswith("#"):
                continue
            values = {}
            for name, idx in col.items():
                if idx >= len(cells) or not cells[idx].strip():
                    raise TraceError(f"{path}:{line}: column {name!r} is missing")
                text = cells[idx].strip()
                try:
                    if name == "arrival_time_s":
                        v = float(text)
                        if not math.isfinite(v) or v < 0:
                            raise ValueError
                    else:
                        fv = float(text)
                        if not fv.is_integer():
                            raise ValueError
                        v = int(fv)
                except ValueError:
                    kind = "a non-negative number of seconds" if name == "arrival_time_s" else "a whole number"
                    raise TraceError(f"{path}:{line}: column {name!r} must be {kind}, got {text!r}") from None
                if name != "arrival_time_s" and v < 1:
                    raise TraceError(f"{path}:{line}: column {name!r} must be >= 1, got {text!r}")
                values[name] = v
            if last is not None and values["arrival_time_s"] < last:
                raise TraceError(f"{path}:{line}: column 'arrival_time_s' goes back in time "
                                 f"({values['arrival_time_s']} after {last}); sort the trace by arrival")
            last = values["arrival_time_s"]
            rows.append(TraceRow(values["arrival_time_s"], values["input_tokens"], values["output_tokens"]))
    if not rows:
        raise TraceError(f"{path}: no requests after the header")
    t0 = rows[0].arrival_s
    for r in rows:
        r.arrival_s -= t0
    return rows


def write_trace(path: str | Path, requests: Sequence[BenchRequest]) -> Path:
    """Writes requests as a trace CSV (replayable with ``--dataset trace:<path>``)."""
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(TRACE_COLUMNS)
        for r in requests:
            w.writerow([f"{r.arrival_s:.6f}", r.input_tokens, r.output_tokens])
    return path


# -- prompts ------------------------------------------------------------------------------------

FALLBACK_WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be "
    "has had one or also new first their its after but who two time year years been can may "
    "other all more some state city over most world used about many between when people during "
    "three into school only where while early made later part such both work use high these "
    "known found four five name small great music water game light house book river power line "
    "film day night team small group order north south east west land old young long place").split()


class PromptBuilder:
    """Makes prompts of a given token length, with the engine's tokenizer when there is one."""

    def __init__(self, tokenizer=None, seed: int = 0, shared_prefix_tokens: int = 0):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng([seed, 3])
        self.shared_prefix_tokens = shared_prefix_tokens
        if tokenizer is not None:
            words: list[int] = []
            for tid in range(tokenizer.vocab_size):
                s = tokenizer.decode([tid])
                if len(s) >= 3 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
                    words.append(tid)
            if len(words) < 16:  # an unusual tokenizer: fall back to any printable token
                words = [tid for tid in range(tokenizer.vocab_size)
                         if (s := tokenizer.decode([tid])).strip() and s.isprintable()]
            if not words:
                raise ValueError("the tokenizer has no printable tokens to build prompts from")
            self.word_ids = np.asarray(words)
            self._special = len(tokenizer.encode("", add_special_tokens=True))
        else:
            self.word_ids = None
            self._special = 0
        # drawn once, from a generator of its own: the same words open every prompt
        self.shared_words = self._words(np.random.default_rng([seed, 5]), shared_prefix_tokens)

    def _words(self, rng, n: int) -> list:
        pool = self.word_ids if self.word_ids is not None else np.arange(len(FALLBACK_WORDS))
        return [int(i) for i in rng.choice(pool, size=max(n, 0))]

    def _text_of(self, words: list) -> str:
        if self.word_ids is None:
            return " ".join(FALLBACK_WORDS[i] for i in words)
        return self.tokenizer.decode(words)

    def _random_text(self, n: int) -> str:
        if self.word_ids is None:
            idx = self.rng.integers(0, len(FALLBACK_WORDS), size=max(n, 0))
            return " ".join(FALLBACK_WORDS[i] for i in idx)
        # each id decodes to " word": keeping the leading space keeps one token per word
        return self._text_of([int(i) for i in self.rng.choice(self.word_ids, size=max(n, 0))])

    def build(self, n_tokens: int) -> tuple[str, int | None, list[int] | None]:
        """(text, measured token count or None, token ids or None) for ``n_tokens`` tokens.

        With a tokenizer the count is exact (BOS included) whenever the tokenizer can express
        it; otherwise the closest length found is returned, and the measured count says so.
        """
        want = max(n_tokens, self._special + 1)
        shared = min(self.shared_prefix_tokens, want - self._special - 1)
        prefix = self._text_of(self.shared_words[:shared]) if shared > 0 else ""
        if self.tokenizer is None:
            rest = self._random_text(n_tokens - max(shared, 0))
            return (f"{prefix} {rest}" if prefix and rest else prefix or rest), None, None
        tok = self.tokenizer
        text = prefix + self._random_text(want - self._special - max(shared, 0))
        ids = tok.encode(text)
        for _ in range(32):
            if len(ids) == want:
                break
            if len(ids) > want:  # cut whole words off the end (not into the shared words), then characters
                words = text.split(" ")
                cut = min(len(ids) - want, len(words) - 1 - max(shared, 0))
                text = " ".join(words[:-cut]) if cut > 0 else text[:-1]
            else:
                text += self._random_text(want - len(ids))
            ids = tok.encode(text)
        return text, len(ids), ids


def load_tokenizer(engine_dir: str | Path | None = None, tokenizer_path: str | Path | None = None):
    """The project's Tokenizer for an engine directory (or a tokenizer path); None if neither."""
    from bullet_trt.model.tokenizer import Tokenizer

    if tokenizer_path:
        return Tokenizer(tokenizer_path)
    if engine_dir:
        from bullet_trt.config import load_engine_config
        return Tokenizer(load_engine_config(engine_dir).tokenizer_path)
    return None


def engine_max_model_len(engine_dir: str | Path | None) -> int | None:
    if not engine_dir:
        return None
    from bullet_trt.config import load_engine_config
    return load_engine_config(engine_dir).max_model_len


# -- workloads ----------------------------------------------------------------------------------

@dataclass
class Workload:
    dataset: str
    rate: float  # req/s (the trace's own mean rate when replayed unscaled)
    seed: int
    requests: list[BenchRequest]
    source: str = ""

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def lengths(self) -> dict:
        return describe([r.input_tokens for r in self.requests], [r.output_tokens for r in self.requests])


def is_trace(dataset: str) -> bool:
    return dataset.startswith("trace:")


def build_workload(dataset: str, rate: float | None, num_requests: int | None = None,
                   duration_s: float | None = None, seed: int = 0, tokenizer=None,
                   max_model_len: int | None = None, max_output_tokens: int | None = None,
                   prompts: bool = True, shared_prefix_tokens: int = 0) -> Workload:
    """The requests of one run.

    ``dataset`` is ``sharegpt``, ``azure-conv``, ``azure-code`` or ``trace:<file.csv>``. For a
    trace, ``rate`` None replays its own arrival times; a rate rescales them in time so the
    mean rate is ``rate`` (the order and the gaps' shape are kept). ``num_requests`` and
    ``duration_s`` limit the run (the first n requests / those arriving within the duration).
    """
    if is_trace(dataset):
        rows = read_trace(dataset[len("trace:"):])
        if num_requests:
            rows = rows[:num_requests]
        arrivals = np.array([r.arrival_s for r in rows])
        span = arrivals[-1] if len(arrivals) > 1 else 0.0
        native = (len(rows) - 1) / span if span > 0 else float("inf")
        if rate is not None and span > 0:
            arrivals = arrivals * (native / rate)
        if duration_s is not None:
            keep = max(1, int(np.searchsorted(arrivals, duration_s, side="right")))
            rows, arrivals = rows[:keep], arrivals[:keep]
        inputs, outputs = clip_lengths([r.input_tokens for r in rows], [r.output_tokens for r in rows],
                                       None, max_model_len, max_output_tokens)
        rate_out = rate if rate is not None else native
        source = f"trace {dataset[len('trace:'):]} ({'rescaled to ' + str(rate) + ' req/s' if rate else 'native timing'})"
    else:
        spec = get_spec(dataset)
        if rate is None:
            raise ValueError(f"dataset {dataset} needs a request rate")
        if num_requests is None:
            if duration_s is None:
                raise ValueError("give the number of requests or a duration")
            num_requests = count_for_duration(duration_s, rate, seed)
        arrivals = poisson_arrivals(num_requests, rate, seed)
        inputs, outputs = sample_lengths(spec, num_requests, seed, max_model_len, max_output_tokens)
        rate_out = rate
        source = spec.source
    builder = PromptBuilder(tokenizer, seed, shared_prefix_tokens) if prompts else None
    if shared_prefix_tokens:
        source += f"; every prompt opens with the same {shared_prefix_tokens} tokens"
    requests = []
    for i, (t, n_in, n_out) in enumerate(zip(arrivals, inputs, outputs)):
        req = BenchRequest(i, float(t), int(n_in), int(n_out))
        if builder is not None:
            req.prompt, req.prompt_tokens, req.prompt_ids = builder.build(int(n_in))
        requests.append(req)
    return Workload(dataset, float(rate_out), seed, requests, source)
