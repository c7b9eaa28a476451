"""Loading Hugging Face safetensors checkpoints into CausalLM: the whole model, or under tensor
parallelism the slices of it that the model's rank holds (read from the file as slices).

A fine-grained FP8 checkpoint (``ModelArch.fp8_checkpoint``) stores its linear layers' weights
as E4M3 blocks with a ``weight_scale_inv`` beside each: FP8 experts keep them as they are, every
other parameter takes them dequantized into the model's dtype."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from bullet_trt.kernels import fp8_blocks
from bullet_trt.model.arch import ModelArch
from bullet_trt.model.expert_weights import Fp8Target, checkpoint_destinations, is_expert_tensor
from bullet_trt.model.tensor_parallel import Shard
from bullet_trt.model.transformer import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_NAMED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(arch: ModelArch, requested: str, device: torch.device | str) -> torch.dtype:
    """The compute dtype for ``requested`` (auto | float32 | bfloat16 | float16).

    ``auto`` keeps a half-precision checkpoint's dtype on GPU and serves a float32 one (or one
    that does not say) in bfloat16, as serving engines do (vLLM's ``auto`` casts float32 down
    too): float32 doubles the bytes every decode step reads and leaves the tensor cores idle;
    ``float32`` keeps it. On CPU ``auto`` is float32: CPU half-precision matmuls are slow, and
    float32 keeps CPU results comparable to the transformers oracle.
    """
    if requested != "auto":
        if requested not in _NAMED_DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {requested!r}")
        return _NAMED_DTYPES[requested]
    if torch.device(device).type == "cpu":
        return torch.float32
    if arch.torch_dtype in (torch.float16, torch.bfloat16):
        return arch.torch_dtype
    return torch.bfloat16


def checkpoint_files(checkpoint_dir: str | Path) -> tuple[Path, dict[str, Path]]:
    """(the index or single file, {tensor name: the safetensors file that holds it})."""
    root = Path(checkpoint_dir)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root / 'config.json'} not found: not a Hugging Face checkpoint directory")
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map'")
        for shard in sorted(set(weight_map.values())):
            if not (root / shard).is_file():
                raise FileNotFoundError(f"{index} names shard {shard!r}, but {root / shard} does not exist")
        return index, {name: root / shard for name, shard in weight_map.items()}
    single = root / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")
    with safe_open(single, framework="pt") as f:
        return single, {name: single for name in f.keys()}


def _ignored(name: str, arch: ModelArch) -> bool:
    # Old checkpoints saved RoPE inv_freq buffers; tied models may still carry an lm_head copy.
    return name.endswith("rotary_emb.inv_freq") or (arch.tie_word_embeddings and name == "lm_head.weight")


SCALE_SUFFIX = "_scale_inv"  # an FP8 checkpoint's block scales: `X.weight_scale_inv` beside `X.weight`


def _read(f, name: str, shard: Shard, arch: ModelArch, dest: torch.Tensor | Fp8Target, dtype: torch.dtype,
          path: Path, scale: torch.Tensor | None = None) -> None:
    """Copies this rank's part of tensor ``name`` into ``dest``, reading only that part.
    ``scale``: the tensor is FP8 blocks with these scales (an FP8 checkpoint's), which an FP8
    expert keeps as they are and every other parameter takes dequantized."""
    view = f.get_slice(name)
    shape = tuple(view.get_shape())
    part = shard.checkpoint_slice(name, arch)
    whole, sliced = (lambda: f.get_tensor(name)), (lambda index: view[index])
    if scale is not None:
        blocks = f.get_tensor(name)
        if blocks.dtype != fp8_blocks.FP8 or tuple(scale.shape) != fp8_blocks.scale_shape(*shape[-2:]):
            raise ValueError(f"{path}: tensor {name!r} ({blocks.dtype}, {shape}) and its {name + SCALE_SUFFIX} "
                             f"{tuple(scale.shape)} are not FP8 blocks of 128 x 128")
        if isinstance(dest, Fp8Target) and part is None and not dest.gate_up and shape == tuple(dest.shape):
            dest.weight.copy_(blocks)  # kept as the checkpoint quantized it
            dest.scale.copy_(scale)
            return
        weights = fp8_blocks.dequantize(blocks, scale, torch.float32)
        whole, sliced = (lambda: weights), (lambda index: weights[index])
    if part is None:
        if shape != tuple(dest.shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {shape}, the model expects {tuple(dest.shape)}")
        if isinstance(dest, Fp8Target):
            dest.fill(whole())
        else:
            dest.copy_(whole().to(dtype))
        return
    expected = list(dest.shape)
    expected[part.dim] = part.full
    if shape != tuple(expected):
        raise ValueError(f"{path}: tensor {name!r} has shape {shape}, the model expects {tuple(expected)}")
    index = (slice(None),) * part.dim + (slice(part.start, part.stop),)
    if isinstance(dest, Fp8Target):  # a rank's range of stacked experts, which it holds whole
        dest.fill(sliced(index))
        return
    rows = part.stop - part.start
    # the vocabulary's last range is padded: rows past the vocabulary stay zero
    target = dest.narrow(part.dim, 0, rows)
    target.copy_(sliced(index).to(dtype))
    if rows < dest.shape[part.dim]:
        dest.narrow(part.dim, rows, dest.shape[part.dim] - rows).zero_()


def _scale(f, path: Path, files: dict[str, Path], name: str) -> torch.Tensor | None:
    """The block scales of an FP8 checkpoint's tensor ``name``: from ``f``, the open file at
    ``path`` that holds the tensor, where they are beside it (opening a shard parses its whole
    header), else from whichever file holds them."""
    where = files.get(name + SCALE_SUFFIX)
    if where is None:
        return None
    if where == path:
        return f.get_tensor(name + SCALE_SUFFIX).float()
    with safe_open(where, framework="pt") as other:
        return other.get_tensor(name + SCALE_SUFFIX).float()


@torch.no_grad()
def load_checkpoint(model: CausalLM, checkpoint_dir: str | Path, dtype: torch.dtype) -> None:
    """Copies every parameter from the checkpoint into ``model`` (this rank's part of each under
    tensor parallelism), cast to ``dtype``."""
    source, files = checkpoint_files(checkpoint_dir)
    arch, shard = model.arch, model.shard
    # keyed by checkpoint tensor: stacked expert parameters are filled expert by expert
    params = checkpoint_destinations(dict(model.named_parameters()), files, shard.experts(arch)[0])
    for name in params:
        if name not in files:
            raise ValueError(f"{source}: tensor {name!r} is missing from the checkpoint")
    for name, path in files.items():
        # an FP8 checkpoint's scales count as their weight
        weight = name.removesuffix(SCALE_SUFFIX) if arch.fp8_checkpoint else name
        other_ranks = is_expert_tensor(weight, arch.moe_layers, arch.num_experts)
        if weight not in params and not _ignored(weight, arch) and not other_ranks:
            raise ValueError(f"{path}: unexpected tensor {name!r} (the model has no such parameter)")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(files[name], []).append(name)
    for path, names in sorted(by_file.items()):
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise ValueError(f"{path}: tensor {name!r} is missing (the index says it is here)")
                scale = _scale(f, path, files, name) if arch.fp8_checkpoint else None
                _read(f, name, shard, arch, params[name], dtype, path, scale)
