"""Tokenizer loading (a checkpoint's tokenizer.json) and streaming detokenization."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    return value.get("content") if isinstance(value, dict) else value


def _as_list(value: Any) -> list[int]:
    return [] if value is None else [int(v) for v in (value if isinstance(value, list) else [value])]


class Tokenizer:
    """A Hugging Face ``tokenizer.json`` plus the special-token facts that live next to it."""

    def __init__(self, path: str | Path):
        file = Path(path)  # a checkpoint directory or the tokenizer.json itself
        if not file.name.endswith(".json"):
            file = file / "tokenizer.json"
        root = file.parent
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: the tokenizer must be a Hugging Face tokenizer.json")
        self._tok = tokenizers.Tokenizer.from_file(str(file))
        self._max_token_bytes: int | None = None
        tok_cfg = _read_json(root / "tokenizer_config.json")
        model_cfg = _read_json(root / "config.json")
        gen_cfg = _read_json(root / "generation_config.json")

        bos_text = _token_text(tok_cfg.get("bos_token"))
        bos = self._tok.token_to_id(bos_text) if bos_text else None
        self.bos_token_id: int | None = bos if bos is not None else model_cfg.get("bos_token_id")
        # None: trust the post-processor; True/False: the checkpoint states it explicitly.
        self.add_bos_token: bool | None = tok_cfg.get("add_bos_token")

        # generation_config.json is what transformers' generate() stops on; the model config
        # and the tokenizer's eos_token may list others (chat models often differ). Stop on all.
        eos_text = _token_text(tok_cfg.get("eos_token"))
        eos_tok = self._tok.token_to_id(eos_text) if eos_text else None
        eos: list[int] = []
        for tid in _as_list(gen_cfg.get("eos_token_id")) + _as_list(model_cfg.get("eos_token_id")) + _as_list(eos_tok):
            if tid not in eos:
                eos.append(tid)
        self.eos_token_ids = eos

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """No token decodes to more UTF-8 bytes than this, so a text of n bytes needs at
        least n / max_token_bytes tokens: servers refuse a prompt that long without spending
        seconds to tokenize megabytes. A token's string in the vocabulary is never shorter
        than what it decodes to (byte-level "Ġ" is two bytes for one, "▁" three, "<0xE3>" six).
        A normalizer that deletes characters would break the bound; those of the byte-level
        and byte-fallback tokenizers served here do not."""
        if self._max_token_bytes is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode("utf-8")) for t in vocab), default=1)
        return self._max_token_bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None or self.add_bos_token is None:
            return ids
        starts_with_bos = bool(ids) and ids[0] == bos
        if self.add_bos_token and not starts_with_bos:
            return [bos] + ids
        if not self.add_bos_token and starts_with_bos and not text.startswith(self._tok.id_to_token(bos) or "\0"):
            return ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stop_sequences(self, words: list[str]) -> list[list[int]]:
        """Token ids of each stop word, encoded as plain text (no BOS); empty words dropped."""
        return [ids for ids in (self.encode(w, add_special_tokens=False) for w in words) if ids]


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of final text pieces.

    Concatenating every ``step`` result and ``flush()`` gives exactly
    ``tokenizer.decode(output_ids)``: the same text a non-streaming response carries, so
    streaming and non-streaming clients see the same output. ``prompt_ids`` is accepted for
    symmetry with other servers but deliberately not used as decoding context: with
    SentencePiece decoders that strip the first leading space, prompt context would make the
    stream differ from that decode.

    Decoding all ids at every step is quadratic; instead each step decodes a short window
    ``ids[prefix_offset:]`` and emits what it adds beyond ``ids[prefix_offset:read_offset]``.
    Decoding from a token boundary keeps word-initial spaces (byte-level "Ġ", SentencePiece
    "▁") right, and text ending in U+FFFD is held back because the next token may complete
    a multi-byte character.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset:])
        if window_text.startswith(prefix_text):
            new_text = window_text[len(prefix_text):]
        else:
            # The window is not self-contained (a decoder that looks across it); fall back to
            # the full decode, which is correct by definition.
            full = self._decode(self.ids)
            new_text = full[len(self.text):] if full.startswith(self.text) else ""
        if not new_text or (new_text.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new_text
        return new_text
