"""Tokenization with the bundle's tokenizer: ids for the model, tokens and offsets for clients."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from service.engine.errors import TooLarge


@dataclass(frozen=True)
class TokenizedText:
    ids: np.ndarray  # int64 (n_tokens,), special tokens included
    encoding: Encoding
    truncated: bool

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def type_ids(self) -> np.ndarray:
        """Token types: 0, and 1 for the second text of a pair where the model has two segments."""
        return np.asarray(self.encoding.type_ids, dtype=np.int64)


class TextTokenizer:
    """Wraps `tokenizers.Tokenizer`; refuses over-long texts when truncation is off."""

    def __init__(self, path: Path, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._truncating = Tokenizer.from_file(str(path))
        self._truncating.no_padding()
        self._truncating.enable_truncation(max_tokens)
        self._whole = Tokenizer.from_str(self._truncating.to_str())
        self._whole.no_truncation()
        self._windowing: OrderedDict[tuple[int, int], Tokenizer] = OrderedDict()  # by (tokens, overlap), a few
        self._windowing_lock = threading.Lock()
        self.special_tokens = self._whole.num_special_tokens_to_add(False)  # per single text ([CLS] ... [SEP])

    def encode(self, texts: list[str], truncate: bool) -> list[TokenizedText]:
        """Tokenize texts; with truncate=False, a text over max_tokens is a 413 naming it."""
        return self._encode(texts, truncate, "input", "send truncate=true to cut it")

    def encode_pairs(self, pairs: list[tuple[str, str]], truncate: bool) -> list[TokenizedText]:
        """Text pairs (query, document) as the checkpoint's tokenizer joins them: its separators and
        token types; with truncate, the longer side is cut first (`longest_first`, as transformers
        does), else a pair over max_tokens is a 413 naming it."""
        return self._encode(pairs, truncate, "pair", "send truncate=true to cut the longer side")

    def _encode(self, items: list, truncate: bool, what: str, advice: str) -> list[TokenizedText]:
        """One batch call of the truncating tokenizer, or of the whole one with each item checked
        against max_tokens (a 413 naming the first over it)."""
        encodings = (self._truncating if truncate else self._whole).encode_batch(items)
        if not truncate:
            for i, e in enumerate(encodings):
                if len(e.ids) > self.max_tokens:
                    raise TooLarge(f"{what} {i} has {len(e.ids)} tokens; the model's limit is {self.max_tokens} ({advice})")
        return [TokenizedText(np.asarray(e.ids, dtype=np.int64), e, truncated=bool(e.overflowing)) for e in encodings]

    def chunk_counts(self, texts: list[str], tokens: int, overlap: int, stop_above: int) -> list[tuple[int, int]]:
        """(windows, tokens) per text that encode_chunks would make, from a stride-free tokenization
        without offsets, text by text until their tokens pass `stop_above` (the token budget: such a
        request is refused, the texts after need no tokenizing). No window exists yet: 16 texts of 100k
        characters in windows of 8 tokens were 250k Encoding objects, 3 GB, when windowed first."""
        counts: list[tuple[int, int]] = []
        total = 0
        for text in texts:
            n = len(self._whole.encode_batch_fast([text])[0].ids) - self.special_tokens
            counts.append(chunk_count(n, tokens - self.special_tokens, overlap, self.special_tokens))
            total += counts[-1][1]
            if total > stop_above:
                break
        return counts

    def encode_chunks(self, texts: list[str], tokens: int, overlap: int) -> list[list[TokenizedText]]:
        """Each text as windows of `tokens` tokens (special tokens included), each repeating `overlap`
        tokens of the one before: the tokenizer's own truncation with a stride, so every window has the
        model's special tokens and offsets into the original text. A short text is one chunk."""
        return [[TokenizedText(np.asarray(w.ids, dtype=np.int64), w, truncated=False) for w in (e, *e.overflowing)]
                for e in self._windows(tokens, overlap).encode_batch(texts)]

    def _windows(self, tokens: int, overlap: int) -> Tokenizer:
        with self._windowing_lock:
            key = (tokens, overlap)
            if key not in self._windowing:
                tokenizer = Tokenizer.from_str(self._whole.to_str())
                tokenizer.enable_truncation(tokens, stride=overlap)
                self._windowing[key] = tokenizer
                if len(self._windowing) > 4:
                    self._windowing.popitem(last=False)
            self._windowing.move_to_end(key)
            return self._windowing[key]


def chunk_count(n: int, room: int, overlap: int, special: int) -> tuple[int, int]:
    """The windows of a text of `n` tokens (special ones not counted) as the tokenizer's truncation with
    a stride cuts it: `room` tokens a window, each starting `room - overlap` after the one before, the
    last ending at the text's end; and their tokens, the repeated and the special ones included."""
    windows = 1 if n <= room else 1 + -(-(n - room) // (room - overlap))
    return windows, n + (windows - 1) * overlap + windows * special


def char_span(encoding: Encoding) -> tuple[int, int]:
    """The characters of the text a chunk covers: from its first real token's start to its last's end."""
    real = [o for o, special in zip(encoding.offsets, encoding.special_tokens_mask, strict=True) if not special]
    return (real[0][0], real[-1][1]) if real else (0, 0)


def token_list(encoding: Encoding) -> list[dict]:
    """Tokens with ids and character offsets into the original text."""
    return [
        {"id": i, "token": t, "start": s, "end": e, "special": bool(special)}
        for i, t, (s, e), special in zip(
            encoding.ids, encoding.tokens, encoding.offsets, encoding.special_tokens_mask, strict=True
        )
    ]
