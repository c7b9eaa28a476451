"""Opening the benchmark's files as they are kept: plain, gzipped (``.gz``) or xz-compressed
(``.xz``, a tenth of the plain size for result JSON), chosen by the file's suffix."""
from __future__ import annotations

import gzip
import lzma
from pathlib import Path

_OPENERS = {".gz": gzip.open, ".xz": lzma.open}


def open_kept(path: str | Path, mode: str = "rb"):
    return _OPENERS.get(Path(path).suffix, open)(path, mode)
