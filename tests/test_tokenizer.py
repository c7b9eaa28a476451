"""Tokenizer loading, streaming detokenization and the corpus tokenizer of random-weight engines."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as HFTokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

from bullet_trt.model.corpus_tokenizer import BOS, CORPUS, EOS, train_corpus_tokenizer, write_corpus_tokenizer
from bullet_trt.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = {
    "ascii": "Hello world, this is a test of the tokenizer. It works!",
    "spaces": "   leading spaces,  double  spaces\n\n  and an indented line\tand a tab ",
    "emoji": "I love 🐍 and 🚀! 😎👍🏽 family: 👨‍👩‍👧 done 🙂",
    "cjk": "東京は大きな都市です。北京的天气很好。서울의 밤은 밝다.",
    "mixed": "café naïve Straße — “quotes” → ∞ 😀東京 end",
}


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    return Tokenizer(write_corpus_tokenizer(tmp_path_factory.mktemp("default")))


@pytest.fixture(scope="module")
def sentencepiece_like(tmp_path_factory) -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" word markers, byte-fallback tokens for rare characters,
    and a decoder that strips the first leading space."""
    tok = HFTokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # A small alphabet leaves most CJK and emoji to byte fallback, split across tokens.
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(), trainers.BpeTrainer(
        vocab_size=800, limit_alphabet=80, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"].update(byte_fallback=True, unk_token="<unk>")
    data["decoder"] = json.loads(decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ]).__getstate__())
    root = tmp_path_factory.mktemp("spm")
    (root / "tokenizer.json").write_text(json.dumps(data))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return Tokenizer(root)


def stream(tok: Tokenizer, ids: list[int], sizes) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=[])
    pieces, i = [], 0
    while i < len(ids):
        n = next(sizes)
        pieces.append(detok.step(ids[i:i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_incremental_detokenization_equals_full_decode(request, kind, name):
    tok: Tokenizer = request.getfixturevalue(kind)
    ids = tok.encode(TEXTS[name], add_special_tokens=False)
    full = tok.decode(ids)
    assert full == TEXTS[name] or kind == "sentencepiece_like"  # byte-level round-trips exactly
    one_by_one = stream(tok, ids, iter(lambda: 1, None))
    assert "".join(one_by_one) == full
    assert all("\ufffd" not in p for p in one_by_one)  # split characters were held back, not mangled
    rng = random.Random(name)
    assert "".join(stream(tok, ids, iter(lambda: rng.randint(1, 4), None))) == full


def test_multibyte_characters_are_split_across_tokens(byte_level, sentencepiece_like):
    """The texts really exercise hold-back: some single tokens decode to U+FFFD."""
    for tok in (byte_level, sentencepiece_like):
        ids = tok.encode(TEXTS["emoji"] + TEXTS["cjk"], add_special_tokens=False)
        assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_stream_with_special_tokens_and_prompt(byte_level):
    prompt = byte_level.encode("Say something:")
    out = byte_level.encode(" sure, 東京 🙂", add_special_tokens=False) + byte_level.eos_token_ids
    pieces = stream(byte_level, out, iter(lambda: 1, None))
    assert "".join(pieces) == byte_level.decode(out) == " sure, 東京 🙂"
    keep = IncrementalDetokenizer(byte_level, prompt, skip_special_tokens=False)
    assert "".join(keep.step([i]) for i in out) + keep.flush() == " sure, 東京 🙂" + EOS


def test_special_tokens_and_bos(byte_level, sentencepiece_like, tmp_path):
    ids = byte_level.encode("hi there")
    assert ids[0] == byte_level.bos_token_id == 0 and byte_level.decode(ids) == "hi there"
    assert byte_level.encode("hi there", add_special_tokens=False) == ids[1:]
    assert byte_level.eos_token_ids == [1] and byte_level.vocab_size == 2048
    # add_bos_token in tokenizer_config.json adds BOS even though that post-processor does not.
    spm_ids = sentencepiece_like.encode("hello")
    assert spm_ids[0] == sentencepiece_like.bos_token_id
    assert spm_ids[1:] == sentencepiece_like.encode("hello", add_special_tokens=False)
    assert sentencepiece_like.eos_token_ids == [sentencepiece_like._tok.token_to_id("</s>")]

    write_corpus_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, add_bos_token=False)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    tok = Tokenizer(tmp_path)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.eos_token_ids == [7, 1]


def test_stop_sequences(byte_level):
    stops = byte_level.stop_sequences(["\n\n", "END", ""])
    assert len(stops) == 2 and all(s and s[0] != byte_level.bos_token_id for s in stops)
    assert byte_level.decode(stops[1]) == "END"


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_corpus_tokenizer_training_is_deterministic(tmp_path):
    a = train_corpus_tokenizer().to_str()
    assert train_corpus_tokenizer().to_str() == a
    # A fresh process has fresh hash seeds and thread pool: still byte-identical files.
    write_corpus_tokenizer(tmp_path / "here")
    code = "import sys; from bullet_trt.model.corpus_tokenizer import write_corpus_tokenizer as w; w(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True,
                   env={"RAYON_NUM_THREADS": "2", "PYTHONPATH": str(CORPUS.parents[2])})
    here = (tmp_path / "here" / "tokenizer.json").read_bytes()
    assert here == (tmp_path / "there" / "tokenizer.json").read_bytes()
    tok = HFTokenizer.from_str(a)
    assert tok.get_vocab_size() == 2048 and tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
