"""serve.calibrate=auto: a server on a GPU its engine directory has no calibration for
measures that GPU once, before it loads the model, and stores the result next to the engine.

Without it the Bullet policy plans splits from uncalibrated defaults, or, as happened on an
H100 served with the H200's calibration, from another GPU's figures (docs/benchmarks.md).
The measurement runs in a child process, so its memory and CUDA context are gone before the
server allocates its own; if it fails the server still starts, on the defaults, and says so.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from bullet_trt.config import EngineConfig
from bullet_trt.model.arch import ModelArch
from bullet_trt.serving.device_sizing import (GRAPH_BUCKETS, MAX_DECODE_ROWS, served_chunk, sized_chunk,
                                              sized_mode, sized_prefill_pieces)
from bullet_trt.spatial.calibration_store import CalibrationKey, find_calibration


def calibration_overrides(cfg: EngineConfig) -> dict:
    """The run's own overrides, with decode batches up to the largest a sized server may pick
    (its graphs too: a decode step measured without one is not the step served), and the
    spatial prefill worker's piecewise graphs as sizing will give them (a prefill measured
    eagerly is not the step served either). Only the spatial modes' scheduler reads the prefill
    figures, while a chunked server calibrates too (its decode figures bound its rows) into the
    same file: its prefill is measured as a sized bullet worker's, not through its own mixed
    steps' buckets or chunk."""
    given = {key: functools.reduce(getattr, key.split("."), cfg) for key in cfg.overridden}
    sized = {"decode.max_num_seqs": MAX_DECODE_ROWS, "decode.max_num_batched_tokens": MAX_DECODE_ROWS,
             "decode.cuda_graph_batch_sizes": list(GRAPH_BUCKETS)}
    mode = sized_mode(cfg)
    if mode == "chunked":
        given.pop("prefill.piecewise_graph_tokens", None)
        given.pop("serve.chunk_size", None)
    if cfg.serve.sizing == "auto":
        spatial = "bullet" if mode == "chunked" else mode
        chunk = sized_chunk(cfg, spatial) if mode == "chunked" else served_chunk(cfg, mode)
        pieces = sized_prefill_pieces(cfg, ModelArch.from_checkpoint(cfg.checkpoint_path), spatial, chunk)
        if pieces:
            sized["prefill.piecewise_graph_tokens"] = pieces
    return {**sized, **given}


def _missing_calibration(cfg: EngineConfig) -> tuple[str, Path, str] | None:
    """(why this server should calibrate first, where it stores the result, what it serves on
    if it cannot), or None."""
    if cfg.serve.calibrate == "off" or cfg.resolve_device() == "cpu":
        return None
    if cfg.parallel.tensor_parallel_size > 1:
        # a rank's step includes collectives that one GPU cannot measure (docs/scale-out.md)
        return None
    import torch

    from bullet_trt.model.loader import resolve_dtype

    props = torch.cuda.get_device_properties(torch.device(cfg.resolve_device()))
    arch = ModelArch.from_checkpoint(cfg.checkpoint_path)
    key = CalibrationKey.for_server(cfg, arch, props.name, props.multi_processor_count,
                                    resolve_dtype(arch, cfg.dtype, "cuda"))
    found = find_calibration(cfg.engine_dir, key)
    target = key.file(cfg.engine_dir)
    if found.path is None:
        return found.note, target, "uncalibrated defaults"
    if found.stale:
        return f"{found.note} is stale ({found.stale})", target, f"the stale {found.path.name}"
    return None


def needs_calibration(cfg: EngineConfig) -> str | None:
    """Why this server should calibrate first, or None."""
    missing = _missing_calibration(cfg)
    return None if missing is None else missing[0]


def ensure_calibrated(cfg: EngineConfig) -> None:
    missing = _missing_calibration(cfg)
    if missing is None:
        return
    reason, target, fallback = missing
    if not os.access(cfg.engine_dir, os.W_OK):
        print(f"bullet_trt: {reason}, and the engine directory is read-only: {fallback} "
              f"(calibrate with `bullet-trt build --profile --out {cfg.engine_dir}`)", file=sys.stderr, flush=True)
        return
    print(f"bullet_trt: {reason}: measuring this GPU once for the performance model, into {target} "
          "(serve.calibrate=off skips this)", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "bullet_trt.spatial.calibrate", str(cfg.engine_dir),
                           "--overrides", json.dumps(calibration_overrides(cfg))],
                          stdout=sys.stderr, stderr=sys.stderr)
    if done.returncode != 0:
        print(f"bullet_trt: calibration failed (exit {done.returncode}); serving on {fallback}",
              file=sys.stderr, flush=True)
