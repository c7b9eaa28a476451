"""Result files of the serving benchmark: one JSON per run (one label, dataset, rate and
seed), named so that runs of several configurations share one directory and one report.
"""
from __future__ import annotations

import datetime as _dt
import gzip
import hashlib
import json
import lzma
import os
import re
from pathlib import Path
from typing import Sequence

from bullet_trt.tools.bench import datasets as ds
from bullet_trt.tools.bench.kept_files import open_kept
from bullet_trt.tools.bench.metrics import RequestRecord, summarize

# Kept from when the benchmark was one module: result files already written carry it.
RESULT_KIND = "bullet_trt.serve_bench"


# A label spelling out long settings (every CUDA-graph size) must still name files: a path
# component holds 255 bytes, and the round's archive adds its own suffixes to these names.
SLUG_MAX_CHARS = 150


def slug(text: str) -> str:
    """``text`` as a file-name part; past SLUG_MAX_CHARS cut and ended by a digest of the whole
    text, so two long labels that share their start still name different files."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"
    if len(name) <= SLUG_MAX_CHARS:
        return name
    digest = hashlib.sha1(text.encode()).hexdigest()[:10]
    return f"{name[:SLUG_MAX_CHARS - len(digest) - 1].rstrip('-')}-{digest}"


def dataset_name(dataset: str) -> str:
    """``trace:/a/b/azure.csv`` -> ``trace-azure``; synthetic names unchanged."""
    if ds.is_trace(dataset):
        return "trace-" + slug(Path(dataset[len("trace:"):]).stem)
    return dataset


def result_path(out_dir: Path, label: str, dataset: str, rate: float, seed: int = 0) -> Path:
    repeat = f"__seed{seed}" if seed else ""
    return Path(out_dir) / f"{slug(label)}__{slug(dataset_name(dataset))}__rate{rate:g}{repeat}.json"


def write_result(out_dir: Path, *, label: str, dataset: str, rate: float, seed: int, backend: str,
                 records: Sequence[RequestRecord], workload: ds.Workload, ttft_slo_ms: float,
                 tpot_slo_ms: float, extra: dict | None = None, notes: Sequence[str] = (),
                 stopped_early: str | None = None, token_times: bool = False) -> tuple[Path, dict]:
    """Summarizes one run and writes its JSON; returns (path, the JSON object)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, ttft_slo_ms / 1e3, tpot_slo_ms / 1e3)
    doc = {
        "kind": RESULT_KIND, "version": 1, "label": label, "dataset": dataset_name(dataset),
        "dataset_arg": dataset, "rate": rate, "seed": seed, "backend": backend,
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "slo": {"ttft_ms": ttft_slo_ms, "tpot_ms": tpot_slo_ms},
        "workload": {"num_requests": len(workload.requests), "last_arrival_s": workload.duration_s,
                     "lengths": workload.lengths(), "source": workload.source},
        "summary": summary.to_json(), "stopped_early": stopped_early, "notes": list(notes),
        **(extra or {}),
        "requests": [r.to_json(token_times=token_times) for r in records],
    }
    path = result_path(out_dir, label, dataset, rate, seed)
    # A report rebuilt while this run is written must never read half a file.
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path, doc


def load_result(path: str | Path) -> dict:
    """One result JSON, plain, gzipped or xz-compressed; ValueError when the file is not one."""
    path = Path(path)
    try:
        with open_kept(path) as f:
            doc = json.loads(f.read())
    except (EOFError, ValueError, lzma.LZMAError, gzip.BadGzipFile) as e:  # truncated, not compressed as named, or not JSON
        raise ValueError(f"{path}: not a benchmark result ({e})") from None
    if not (isinstance(doc, dict) and doc.get("kind") == RESULT_KIND):
        raise ValueError(f"{path}: not a benchmark result (kind {RESULT_KIND!r} expected)")
    doc["_path"] = str(path)
    return doc


def load_results(*sources: Path) -> list[dict]:
    """Every result JSON in each source, a directory or one result file, plain or compressed
    (``.json.gz``, ``.json.xz``: kept results, whose per-request arrays --compare needs; xz takes
    about a tenth of the plain size, gzip about a seventh). A file named as a source must be a
    result; a directory's other JSON files are not ours to report and are skipped. A file
    reached twice counts once."""
    docs, seen = [], set()
    for source in map(Path, sources):
        if source.is_dir():
            paths = sorted(p for pattern in ("*.json", "*.json.gz", "*.json.xz") for p in source.glob(pattern))
        elif source.is_file():
            paths = [source]
        else:
            raise FileNotFoundError(f"{source}: no such result file or directory")
        for path in paths:
            if path.resolve() in seen:
                continue
            try:
                doc = load_result(path)
            except (OSError, ValueError):  # unreadable, or not a result
                if path == source:
                    raise
                continue
            seen.add(path.resolve())
            docs.append(doc)
    return docs
