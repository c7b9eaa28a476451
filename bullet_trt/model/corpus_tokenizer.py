"""The tokenizer of engines with random weights (the tiny test model, the dummy-weight presets):
a small byte-level BPE trained on tokenizer_corpus.txt, shipped in the package.

It lets tests and benchmarks run without downloading anything (the default model brings its
own tokenizer). Byte-level means
every string round-trips, including emoji and CJK text the corpus barely covers.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CORPUS = Path(__file__).with_name("tokenizer_corpus.txt")


def train_corpus_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    # BpeTrainer breaks count ties by pair order, so its merges do not depend on thread count
    # or hash seeds (checked: identical files with RAYON_NUM_THREADS 1 and 2, and by a test).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def write_corpus_tokenizer(out_dir: str | Path, vocab_size: int = 2048) -> Path:
    """Writes tokenizer.json and tokenizer_config.json into out_dir; returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_corpus_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
