"""Tuned tile tables of the fused MoE kernels: for one GPU model and one MoE layer shape, the
tile each batch size runs fastest with, as measured by ``bullet-trt bench moe-tune``.

A table is a JSON file in ``moe_tile_tables/`` named by the layer's shape and the device's
name (``table_name``); its rows give, for a number of tokens, the tile and the time measured
with it and with the untuned tile. A call with T tokens takes the row whose token count is
nearest to T. Without a table for the device and shape, ``triton_moe`` falls back to its two
fixed forms. Plain Python and JSON, no Triton: the tuner's merge and the tests use it on CPU.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

TABLES_DIR = Path(__file__).with_name("moe_tile_tables")
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def table_name(device_name: str, num_experts: int, inter: int, hidden: int, top_k: int, dtype: str) -> str:
    """The file name of a table: the layer shape the kernels see on one rank, and the GPU."""
    device = "_".join(device_name.split())
    return f"E={num_experts},N={inter},H={hidden},top_k={top_k},dtype={dtype},device={device}.json"


def fingerprint(device_name: str, num_experts: int, inter: int, hidden: int, top_k: int,
                tables_dir: Path = TABLES_DIR) -> str:
    """Which tiles the kernels take for this GPU and layer shape, as a calibration records it:
    "untuned", or each table's name (any dtype) with a digest of its contents. A calibration
    measured under other tiles describes kernels that no longer run."""
    suffix = table_name(device_name, num_experts, inter, hidden, top_k, "*")
    head, tail = suffix.split("*")
    found = sorted(p for p in tables_dir.glob(f"{head}*{tail}") if p.is_file())
    if not found:
        return "untuned"
    return ",".join(f"{p.name}#{hashlib.sha256(p.read_bytes()).hexdigest()[:12]}" for p in found)


def check_tile(tile: dict, where: str) -> dict:
    """The tile's six launch parameters as ints, or a ValueError naming ``where``."""
    missing = [key for key in TILE_KEYS if not isinstance(tile.get(key), int)]
    if missing:
        raise ValueError(f"{where}: a tile needs int {', '.join(missing)}")
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if tile[key] < 16 or tile[key] & (tile[key] - 1):
            raise ValueError(f"{where}: {key} must be a power of two >= 16, got {tile[key]}")
    return {key: tile[key] for key in TILE_KEYS}


def parse_table(data: dict, where: str) -> tuple[tuple[int, dict], ...]:
    """((tokens, tile), ...) sorted by tokens, from a table's JSON."""
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where}: 'rows' must be a non-empty list")
    parsed = {}
    for i, row in enumerate(rows):
        tokens = row.get("tokens")
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"{where}: rows[{i}].tokens must be an int >= 1, got {tokens!r}")
        parsed[tokens] = check_tile(row.get("tile") or {}, f"{where}: rows[{i}].tile")
    return tuple(sorted(parsed.items()))


@functools.lru_cache(maxsize=None)
def load_table(name: str, tables_dir: Path = TABLES_DIR) -> tuple[tuple[int, dict], ...] | None:
    """The table called ``name`` in ``tables_dir``, or None if there is none."""
    path = tables_dir / name
    if not path.is_file():
        return None
    return parse_table(json.loads(path.read_text()), str(path))


def tile_for(table: tuple[tuple[int, dict], ...], tokens: int) -> dict:
    """The tile of the row nearest ``tokens`` (the smaller on a tie): the tuner's token counts
    are spaced so that neighbouring rows' best tiles differ little."""
    _, tile = min(table, key=lambda row: (abs(row[0] - tokens), row[0]))
    return dict(tile)


def best_rows(timings: list[dict], default_tiles: dict[int, dict]) -> list[dict]:
    """The table's rows from the tuner's timings ({tokens, tile, ms} or {tokens, tile, error}):
    for each token count the fastest tile, with its time and the untuned tile's
    (``default_tiles[tokens]``) when that was timed too."""
    by_tokens: dict[int, list[dict]] = {}
    for t in timings:
        if "ms" in t:
            by_tokens.setdefault(t["tokens"], []).append(t)
    rows = []
    for tokens, timed in sorted(by_tokens.items()):
        best = min(timed, key=lambda t: t["ms"])
        row = {"tokens": tokens, "tile": check_tile(best["tile"], f"tokens {tokens}"), "ms": best["ms"]}
        untuned = next((t["ms"] for t in timed if t["tile"] == default_tiles.get(tokens)), None)
        if untuned is not None:
            row["untuned_ms"] = untuned
        rows.append(row)
    return rows
