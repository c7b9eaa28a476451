#!/usr/bin/env python3
"""Builds an engine directory; the logic is `bullet_trt.tools.build` (also `bullet-trt build`).

    python build_engines.py                                  # the embedded default model
    python build_engines.py --checkpoint /models/Llama-3.1-8B-Instruct --out engines/llama8b
    python build_engines.py --dummy-weights --arch llama-3.1-8b --out engines/llama8b
    python build_engines.py --profile --out engines/llama8b  # calibrate on this GPU
"""
import sys

from bullet_trt.tools.build import main

if __name__ == "__main__":
    sys.exit(main())
