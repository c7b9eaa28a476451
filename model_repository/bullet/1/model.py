"""Triton Python-backend entry point for the `bullet` model; the code lives in bullet_trt.serving.triton.

Run with `bullet-trt serve`, or start tritonserver yourself from the project's environment
(its bin directory first on PATH, so the Python-backend stub picks that interpreter).
"""
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[3]  # <root>/model_repository/bullet/1/model.py
if (_ROOT / "bullet_trt").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bullet_trt.serving.triton.model import TritonPythonModel  # noqa: E402,F401
