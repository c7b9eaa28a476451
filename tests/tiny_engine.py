"""A tiny engine with random weights and the real byte-level BPE tokenizer, built where a test
asks: serving tests that need many requests, or a server of their own, stay fast on two CPU
cores whatever the project's default model is."""
from __future__ import annotations

import json
from pathlib import Path

from bullet_trt.config import EngineConfig, ProfileConfig, save_engine_config
from tests.checkpoints import make_variant

# A request a test holds open (min_tokens = max_tokens) so as to act on it while it runs. The
# hold must outlast what the client waits for first: on a loaded two-core machine a streaming
# client got its first token 3.6 s after the server sent it, by which time this model had
# generated 4000 tokens and finished the request. 16000 tokens take many seconds longer.
HELD_TOKENS = 16000
LONG_CONTEXT = 16384  # max_model_len of an engine that can hold HELD_TOKENS


def tiny_engine(out: Path, max_model_len: int = 512, seed: int = 0) -> Path:
    """max_model_len: a long one lets a request run thousands of steps, for tests that need a
    request to hold its slot while they look at the server."""
    out = Path(out)
    if (out / "engine.yaml").is_file():
        return out
    ckpt = make_variant(out / "checkpoint", "llama", seed=seed)
    config = json.loads((ckpt / "config.json").read_text())
    # plain RoPE: the position limit is only a bound, no weight depends on it
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_model_len)
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    cfg = EngineConfig(
        checkpoint="checkpoint", tokenizer="checkpoint", seed=seed, untrained=True,
        description=f"tiny random test engine (seed {seed})",
        prefill=ProfileConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=max_model_len),
        decode=ProfileConfig(max_num_seqs=16, max_num_batched_tokens=16, max_model_len=max_model_len))
    cfg.kv.cpu_pool_mib = 16
    save_engine_config(cfg, out, header="tiny random test engine")
    return out
