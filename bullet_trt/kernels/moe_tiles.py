"""Tuned tile tables of the fused MoE kernels: for one GPU model and one MoE layer shape, the
tile each batch size runs fastest with, as measured by ``bullet-trt bench moe-tune``.

A table is a JSON file in ``moe_tile_tables/`` named by the layer's shape and the device's
name (``table_name``); its rows give, for a number of tokens, the tile and the time measured
with it and with the untuned tile. A call with T tokens takes the row whose token count is
nearest to T. A table tuned on an SM partition (a green context of N SMs, as a bullet worker
runs on) carries ``,sms=N`` in its name: a kernel call planning for N SMs (``sm_budget``)
takes the table tuned on the SM count nearest N among those whose rows span its token count,
the whole GPU's counting as all its SMs, since the tile that keeps 132 SMs busy can leave 60
short of the memory traffic they could carry.
Without a table for the device and shape, ``triton_moe`` falls back to its two fixed forms.
Plain Python and JSON, no Triton: the tuner's merge and the tests use it on CPU.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

TABLES_DIR = Path(__file__).with_name("moe_tile_tables")
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
# optional: 1 runs the tile's product with the operands swapped (triton_moe's SWAP_AB); absent: 0
SWAP_AB = "SWAP_AB"


def dtype_label(weight_dtype: str, fp8_activations: bool = False) -> str:
    """A table's dtype in its name: the experts' weights', and ``_w8a8`` where the activations
    are rounded to FP8 too (other products: other best tiles)."""
    return f"{weight_dtype}_w8a8" if fp8_activations else weight_dtype


def table_name(device_name: str, num_experts: int, inter: int, hidden: int, top_k: int, dtype: str,
               sms: int | None = None) -> str:
    """The file name of a table: the layer shape the kernels see on one rank, the GPU, and the
    SM partition it was tuned on (None: the whole GPU)."""
    device = "_".join(device_name.split())
    partition = f",sms={sms}" if sms is not None else ""
    return f"E={num_experts},N={inter},H={hidden},top_k={top_k},dtype={dtype},device={device}{partition}.json"


def _names(device_name: str, num_experts: int, inter: int, hidden: int, top_k: int,
           dtype: str | None) -> re.Pattern:
    """Matches the names of this GPU's and layer's tables (any dtype when None), the SM count
    a partition's was tuned on as group 1."""
    head, tail = table_name(device_name, num_experts, inter, hidden, top_k, "\0").split("\0")
    dtype_part = "[^,]+" if dtype is None else re.escape(dtype)
    device_part = re.escape(tail.removesuffix(".json"))
    return re.compile(re.escape(head) + dtype_part + device_part + r"(?:,sms=(\d+))?\.json")


def _matching(pattern: re.Pattern, tables_dir: Path) -> list[tuple[Path, re.Match]]:
    """The tables in ``tables_dir`` whose names ``pattern`` matches, in name order."""
    paths = sorted(tables_dir.glob("*.json")) if tables_dir.is_dir() else []
    return [(p, m) for p in paths if (m := pattern.fullmatch(p.name)) and p.is_file()]


def tables_of(device_name: str, num_experts: int, inter: int, hidden: int, top_k: int, dtype: str,
              tables_dir: Path = TABLES_DIR) -> dict[int | None, str]:
    """The names of this GPU's tables for the layer, by the SM count each was tuned on (None:
    the whole GPU)."""
    pattern = _names(device_name, num_experts, inter, hidden, top_k, dtype)
    return {int(m.group(1)) if m.group(1) else None: p.name for p, m in _matching(pattern, tables_dir)}


def nearest_sms(tuned_on: list[int | None], sms: int, total_sms: int) -> int | None:
    """Of the SM counts tables were tuned on (None: the whole GPU, ``total_sms`` of them), the
    one nearest ``sms``, the larger on a tie."""
    def count(k: int | None) -> int:
        return total_sms if k is None else k

    return min(tuned_on, key=lambda k: (abs(count(k) - sms), -count(k)))


def table_for(tables: dict[int | None, tuple[tuple[int, dict], ...]], sms: int, total_sms: int,
              tokens: int) -> tuple[tuple[int, dict], ...]:
    """The table a call of ``tokens`` rows planning for ``sms`` SMs takes: the one tuned on the
    SM count nearest ``sms`` among those whose rows span ``tokens`` (a partition tuned at
    decode's row counts says nothing of a 4096-token prefill), the whole GPU's always among
    them; all of them where none spans it."""
    spanning = [k for k, rows in tables.items() if k is None or rows[0][0] <= tokens <= rows[-1][0]]
    return tables[nearest_sms(spanning or list(tables), sms, total_sms)]


def fingerprint(device_name: str, num_experts: int, inter: int, hidden: int, top_k: int, dtype: str,
                tables_dir: Path = TABLES_DIR) -> str:
    """Which tiles the kernels of ``dtype`` (a table's dtype, ``dtype_label``) take for this GPU
    and layer shape, as a calibration records it: "untuned", or each such table's name (any SM
    partition) with a digest of its contents. A calibration measured under other tiles describes
    kernels that no longer run; another dtype's tables are other kernels, whose tuning leaves it
    true."""
    found = [p for p, _ in _matching(_names(device_name, num_experts, inter, hidden, top_k, dtype), tables_dir)]
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
    if tile.get(SWAP_AB, 0) not in (0, 1):
        raise ValueError(f"{where}: {SWAP_AB} must be 0 or 1, got {tile[SWAP_AB]!r}")
    return {key: tile[key] for key in TILE_KEYS} | ({SWAP_AB: 1} if tile.get(SWAP_AB) else {})


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


def best_rows(timings: list[dict], default_tiles: dict[int, dict],
              before_tiles: dict[int, dict] | None = None) -> list[dict]:
    """The table's rows from the tuner's timings ({tokens, tile, ms} or {tokens, tile, error}):
    for each token count the fastest tile, with its time, the untuned tile's
    (``default_tiles[tokens]``) and the tile the kernels took before this table
    (``before_tiles[tokens]``: an SM partition's nearest table) when those were timed too."""
    by_tokens: dict[int, list[dict]] = {}
    for t in timings:
        if "ms" in t:
            by_tokens.setdefault(t["tokens"], []).append(t)
    rows = []
    for tokens, timed in sorted(by_tokens.items()):
        best = min(timed, key=lambda t: t["ms"])
        row = {"tokens": tokens, "tile": check_tile(best["tile"], f"tokens {tokens}"), "ms": best["ms"]}
        for key, tiles in (("untuned_ms", default_tiles), ("before_ms", before_tiles or {})):
            ms = next((t["ms"] for t in timed if t["tile"] == tiles.get(tokens)), None)
            if ms is not None:
                row[key] = ms
        rows.append(row)
    return rows
