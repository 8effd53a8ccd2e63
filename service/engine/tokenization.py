"""Tokenization with the bundle's tokenizer: ids for the model, tokens and offsets for clients."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from service.engine.errors import InvalidRequest, TooLarge


PLAIN_GROUP = 8  # texts per tokenizer call of encode_plain: its threads share them, the budget is checked between
# The characters bound (issue 55): a text longer than max_tokens x CHARS_PER_TOKEN characters is never tokenized
# whole; only that many of its first (or, cutting from the start, last) characters are. 32 is 6 to 8 times an
# English token's characters and 32 times a CJK one's, so a real text gives its model's limit well inside it;
# 64 texts of 100k characters were 2.3 s and +413 MiB of tokenizer work before their 413.
CHARS_PER_TOKEN = 32
# the first probe takes max_tokens x 8 characters, doubled up to the bound while it gives too few tokens
PROBE_CHARS_PER_TOKEN = 8


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


@dataclass(frozen=True)
class Probe:
    """A long text's first (last) `probed` characters, tokenized: `exact` of their tokens are the whole text's
    own (those of every word but the one the cut may have split, located by the pre-tokenizer's word ids).
    With more than the tokens needed, `piece` is the probe shortened to whole words just past them (what is
    tokenized again, so the second pass costs about the kept tokens' characters); else the probe itself."""

    piece: str
    exact: int
    probed: int


class TextTokenizer:
    """Wraps `tokenizers.Tokenizer`; refuses over-long texts when truncation is off.

    A text past `max_chars` (max_tokens x CHARS_PER_TOKEN) is tokenized by a prefix only, never whole, and
    never to a different answer: its kept tokens are those of the whole text (the prefix's last word, which
    the cut may split, is never among them), with truncation off it is refused once the prefix has more
    tokens than the limit, and a prefix with too few tokens for that (tokens of dozens of characters each)
    is a 413 naming the characters bound rather than a silently different cut."""

    def __init__(self, path: Path, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.max_chars = max_tokens * CHARS_PER_TOKEN
        self._truncating = Tokenizer.from_file(str(path))
        self._truncating.no_padding()
        self._truncating.enable_truncation(max_tokens)
        self._whole = Tokenizer.from_str(self._truncating.to_str())
        self._whole.no_truncation()
        # the same limit cutting a text's start instead of its end (TEI's truncation_direction left,
        # Cohere's truncate START); the special tokens are added after the cut, so [CLS] stays
        self._truncating_left = Tokenizer.from_str(self._truncating.to_str())
        self._truncating_left.enable_truncation(max_tokens, direction="left")
        self._windowing: OrderedDict[tuple[int, int], Tokenizer] = OrderedDict()  # by (tokens, overlap), a few
        self._windowing_lock = threading.Lock()
        self._capped: dict[int, Tokenizer] = {}  # by limit (encode_within)
        self.special_tokens = self._whole.num_special_tokens_to_add(False)  # per single text ([CLS] ... [SEP])

    def probe(self, text: str, need: int, from_start: bool = False) -> Probe:
        """The shortest of the text's first (`from_start`: last) max_tokens x 8, x16, ... characters, up to
        max_chars, with more than `need` exact tokens (special tokens not counted), or the longest probed."""
        size = min(self.max_tokens * PROBE_CHARS_PER_TOKEN, self.max_chars)
        while True:
            piece = text[len(text) - size:] if from_start else text[:size]
            e = self._whole.encode(piece, add_special_tokens=False)
            words = e.word_ids
            edge = (words[0] if from_start else words[-1]) if words else None
            exact = sum(1 for w in words if w != edge)
            if exact > need:
                n = len(words)
                if from_start:  # from the end of the last word before the first dropped token's word
                    dropped = n - need - 1
                    j = next(k for k in range(dropped - 1, -1, -1) if words[k] != words[dropped])
                    return Probe(piece[e.offsets[j][1]:], exact, size)
                j = next(k for k in range(need + 1, n) if words[k] != words[need])  # the word after the first dropped
                return Probe(piece[:e.offsets[j][0]], exact, size)
            if size >= self.max_chars:
                return Probe(piece, exact, size)
            size = min(2 * size, self.max_chars)

    def refusal(self, text: str, truncate: bool, limit: int | None = None, advice: str = "") -> str | None:
        """Why the characters bound refuses a text, or None: a text past max_chars whose first max_chars
        characters give too few tokens to be cut exactly, or (truncate off) already more than `limit` (the
        model's limit, special tokens included; `advice` follows its numbers). Per text, for callers that make
        a refusal one row's error (jobs/embed.py) instead of a request's 413; a length check below the bound."""
        if len(text) <= self.max_chars:
            return None
        limit = min(limit or self.max_tokens, self.max_tokens)
        room = limit - self.special_tokens
        found = self.probe(text, room)
        if found.exact > room:
            return None if truncate else (f"more than the model's limit of {limit} tokens ({found.exact + self.special_tokens} "
                                          f"in its first {found.probed} of {len(text)} characters{advice})")
        return self.bound_reason(len(text), found.exact)

    def bound_reason(self, n_chars: int, exact: int) -> str:
        """The 413's words for a text the characters bound cannot cut exactly."""
        return (f"{n_chars} characters, past the characters bound of {self.max_chars} (the model's {self.max_tokens} "
                f"tokens x {CHARS_PER_TOKEN}), and its first {self.max_chars} characters give only {exact} whole tokens, "
                f"too few to cut it exactly: send it shorter than {self.max_chars} characters")

    def _bounded(self, texts: list[str], truncate: bool, what: str, advice: str, from_start: bool,
                 limit: int) -> list[str]:
        """The texts with each one past max_chars replaced by the prefix (suffix) that gives its kept tokens,
        or a 413 (truncate off: past `limit` tokens; either way: too few tokens within the bound)."""
        if all(len(t) <= self.max_chars for t in texts):
            return texts
        room = limit - self.special_tokens
        out = list(texts)
        for i, text in enumerate(texts):
            if len(text) <= self.max_chars:
                continue
            found = self.probe(text, room, from_start)
            if found.exact <= room:
                raise TooLarge(f"{what} {i} has {self.bound_reason(len(text), found.exact)}")
            if not truncate:
                raise TooLarge(f"{what} {i} has more than {limit} tokens ({found.exact + self.special_tokens} in its "
                               f"{'last' if from_start else 'first'} {found.probed} of {len(text)} characters); "
                               f"the model's limit is {limit} ({advice})")
            out[i] = found.piece
        return out

    def _bounded_pairs(self, pairs: list[tuple[str, str]], truncate: bool, advice: str,
                       from_start: bool) -> list[tuple[str, str]]:
        """Pairs with each side past max_chars replaced by its prefix (suffix), where `longest_first` then
        keeps exactly what it keeps of the whole pair: the cut side keeps more exact tokens than the pair's
        room and than the other side's tokens (the longer side loses the odd token). Both sides past the
        bound with an odd room cannot be told apart without tokenizing them whole: a 413."""
        if all(len(a) <= self.max_chars and len(b) <= self.max_chars for a, b in pairs):
            return pairs
        room = self.max_tokens - self._whole.num_special_tokens_to_add(True)
        out = list(pairs)
        for i, pair in enumerate(pairs):
            long = [len(side) > self.max_chars for side in pair]
            if not any(long):
                continue
            if not truncate:
                found = self.probe(pair[long.index(True)], room, from_start)
                if found.exact <= room:
                    raise TooLarge(f"pair {i} has a text of {self.bound_reason(len(pair[long.index(True)]), found.exact)}")
                raise TooLarge(f"pair {i} has more than {self.max_tokens} tokens; the model's limit is {self.max_tokens} "
                               f"({advice})")
            if all(long) and room % 2:
                raise TooLarge(f"pair {i}: both texts are past the characters bound of {self.max_chars} (the model's "
                               f"{self.max_tokens} tokens x {CHARS_PER_TOKEN}), where which is longer decides the cut: "
                               "send one of them shorter")
            sides = list(pair)
            for k in (0, 1):
                if not long[k]:
                    continue
                other = room if long[1 - k] else max(room, len(self._whole.encode(pair[1 - k], add_special_tokens=False)))
                found = self.probe(pair[k], other, from_start)
                if found.exact <= other:
                    raise TooLarge(f"pair {i} has a text of {self.bound_reason(len(pair[k]), found.exact)}")
                sides[k] = found.piece
            out[i] = (sides[0], sides[1])
        return out

    def encode(self, texts: list[str], truncate: bool, from_start: bool = False, kept: int = 0) -> list[TokenizedText]:
        """Tokenize texts; with truncate=False, a text over max_tokens is a 413 naming it. `from_start`:
        a text past the limit loses its first tokens instead of its last, but never its first `kept`
        characters (the prompt before it: cut away, the model would embed the text as if unprompted, and
        with include_prompt false pooling would skip real text tokens in its place)."""
        return self._encode(texts, truncate, "input", "send truncate=true to cut it", from_start, kept)

    def _cut_after_prefix(self, texts: list[str], kept: int) -> list[TokenizedText]:
        """Left truncation that keeps each text's first `kept` characters: [CLS] prefix, then the last
        tokens of the rest that fit, [SEP]. A text over the limit is cut at the character where its first
        kept token starts (its tokens from the whole text's tokenization) and the prefix and that tail
        are tokenized again: what SentenceTransformer.encode gives for the prompt and the cut text."""
        room = self.max_tokens - self.special_tokens
        bounded, original = [], texts
        for i, text in enumerate(texts):  # past the bound: the prompt, then the tail's last exact characters
            if len(text) > self.max_chars:
                found = self.probe(text[kept:], room, from_start=True)
                if found.exact <= room:
                    raise TooLarge(f"input {i} has {self.bound_reason(len(text), found.exact)}")
                text = text[:kept] + found.piece
            bounded.append(text)
        texts = bounded
        joined, cut = [], []
        for text, e in zip(texts, self._whole.encode_batch(texts, add_special_tokens=False), strict=True):
            n = len(e)
            if n <= room:
                joined.append(text)
                cut.append(False)
                continue
            prefix = next((i for i in range(n) if e.token_to_chars(i)[0] >= kept), n)  # the prompt's tokens
            left = room - prefix
            # a prompt that fills the model alone: cut at the end, as right truncation does
            joined.append(text[:kept] + text[e.token_to_chars(n - left)[0]:] if left > 0 else text)
            cut.append(True)
        cut = [was_cut or len(a) != len(b) for was_cut, a, b in zip(cut, texts, original, strict=True)]
        encodings = self._truncating.encode_batch(joined)
        return [TokenizedText(np.asarray(e.ids, dtype=np.int64), e, truncated=was_cut or bool(e.overflowing))
                for e, was_cut in zip(encodings, cut, strict=True)]

    def encode_within(self, texts: list[str], limit: int, truncate: bool, what: str) -> list[TokenizedText]:
        """Texts cut at `limit` tokens (special tokens included) instead of the model's limit, or with
        truncate=False a 413 naming the first one past it: a ColBERT query's or document's length before
        its marker goes in (PyLate cuts with the tokenizer, as this does)."""
        limit = min(limit, self.max_tokens)
        bounded = self._bounded(texts, truncate, "input", "send truncate=true to cut it", False, limit)
        cut = [len(a) != len(b) for a, b in zip(texts, bounded, strict=True)]
        texts = bounded
        if not truncate:
            encodings = self._whole.encode_batch(texts)
            for i, e in enumerate(encodings):
                if len(e.ids) > limit:
                    raise TooLarge(f"input {i} has {len(e.ids)} tokens; the model's limit for a {what} is {limit} "
                                   "(send truncate=true to cut it)")
            return [TokenizedText(np.asarray(e.ids, dtype=np.int64), e, truncated=False) for e in encodings]
        with self._windowing_lock:  # a few limits per model: a query's and a document's
            tokenizer = self._capped.get(limit)
            if tokenizer is None:
                tokenizer = self._capped[limit] = Tokenizer.from_str(self._truncating.to_str())
                tokenizer.enable_truncation(limit)
        return [TokenizedText(np.asarray(e.ids, dtype=np.int64), e, truncated=was_cut or bool(e.overflowing))
                for e, was_cut in zip(tokenizer.encode_batch(texts), cut, strict=True)]

    def encode_pairs(self, pairs: list[tuple[str, str]], truncate: bool, from_start: bool = False) -> list[TokenizedText]:
        """Text pairs (query, document) as the checkpoint's tokenizer joins them: its separators and
        token types; with truncate, the longer side is cut first (`longest_first`, as transformers
        does), else a pair over max_tokens is a 413 naming it."""
        return self._encode(pairs, truncate, "pair", "send truncate=true to cut the longer side", from_start)

    def _encode(self, items: list, truncate: bool, what: str, advice: str, from_start: bool = False,
                kept: int = 0) -> list[TokenizedText]:
        """One batch call of the truncating tokenizer, or of the whole one with each item checked
        against max_tokens (a 413 naming the first over it). `kept`: see encode."""
        if truncate and from_start and kept:
            return self._cut_after_prefix(items, kept)
        bounded = (self._bounded_pairs(items, truncate, advice, from_start) if what == "pair"
                   else self._bounded(items, truncate, what, advice, from_start, self.max_tokens))
        cut = [a is not b for a, b in zip(items, bounded, strict=True)]
        truncating = self._truncating_left if from_start else self._truncating
        encodings = (truncating if truncate else self._whole).encode_batch(bounded)
        if not truncate:
            for i, e in enumerate(encodings):
                if len(e.ids) > self.max_tokens:
                    raise TooLarge(f"{what} {i} has {len(e.ids)} tokens; the model's limit is {self.max_tokens} ({advice})")
        return [TokenizedText(np.asarray(e.ids, dtype=np.int64), e, truncated=was_cut or bool(e.overflowing))
                for e, was_cut in zip(encodings, cut, strict=True)]

    def encode_plain(self, texts: list[str], add_special_tokens: bool, stop_above: int) -> list[Encoding]:
        """The whole texts' tokens, with or without the model's special tokens (TEI's /tokenize), a few
        texts at a time until their tokens pass `stop_above` (the caller refuses such a request, the
        texts after need no tokenizing: 64 texts of 100k characters were 6M tokens, 3 GB once listed)."""
        encodings: list[Encoding] = []
        total = 0
        for i in range(0, len(texts), PLAIN_GROUP):
            group = self._whole.encode_batch(texts[i:i + PLAIN_GROUP], add_special_tokens=add_special_tokens)
            encodings += group
            total += sum(len(e) for e in group)
            if total > stop_above:
                break
        return encodings

    def tokens_of(self, ids: np.ndarray) -> list[str]:
        """Each vocabulary id's token string (a sparse vector's terms)."""
        return [self._whole.id_to_token(int(i)) or "" for i in ids]

    def decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """Token ids back to text; an id past the vocabulary is a 422 naming it."""
        size = self._whole.get_vocab_size(with_added_tokens=True)
        for i, row in enumerate(ids):
            bad = next((t for t in row if not 0 <= t < size), None)
            if bad is not None:
                raise InvalidRequest(f"ids {i}: token id {bad} is not in the model's vocabulary (0..{size - 1})")
        return self._whole.decode_batch(ids, skip_special_tokens=skip_special_tokens)

    def cut_to_tokens(self, texts: list[str], tokens: int, from_start: bool) -> list[tuple[str, bool]]:
        """Each text cut to its first (or, `from_start`, last) `tokens` tokens, special tokens not
        counted, at the characters those tokens cover; and whether it was cut (Cohere's max_tokens and
        max_tokens_per_doc). A tokenization more per text: callers skip it where `tokens` is past the
        model's own limit, which tokenizing enforces anyway."""
        out = []
        bounded = list(texts)
        for i, text in enumerate(texts):  # past the bound: the characters that hold its first (last) tokens
            if len(text) > self.max_chars:
                found = self.probe(text, tokens, from_start)
                if found.exact <= tokens:
                    raise TooLarge(f"input {i} has {self.bound_reason(len(text), found.exact)}")
                bounded[i] = found.piece
        for text, e in zip(bounded, self._whole.encode_batch(bounded, add_special_tokens=False), strict=True):
            n = len(e)  # token_to_chars, not e.offsets: no list of every token's offsets for one of them
            if n <= tokens:
                out.append((text, False))
            elif from_start:
                out.append((text[e.token_to_chars(n - tokens)[0]:], True))
            else:
                out.append((text[: e.token_to_chars(tokens - 1)[1]] if tokens else "", True))
        return out

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
