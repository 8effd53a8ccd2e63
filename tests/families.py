"""Small random checkpoints of every encoder family we load, built locally (no downloads).

    from tests.families import FAMILIES, make_checkpoint
    path = make_checkpoint("roberta", tmp_path / "roberta", pooling="cls")
    # then: build_bundle(ExportOptions(str(path), out, ...)) or `python -m export --checkpoint path`
    path = make_classifier("electra", tmp_path / "electra-cls", num_labels=3)  # ElectraForSequenceClassification

Each checkpoint is what a user would point `make export CHECKPOINT=DIR` at: config.json and
model.safetensors written by transformers' own classes (`save_pretrained`, safetensors), a fast
tokenizer made here with the `tokenizers` library (tokenizer.json, plus tokenizer_config.json
so that transformers and sentence-transformers load exactly that tokenizer), and
sentence-transformers' modules.json, sentence_bert_config.json and 1_Pooling/config.json.
Models are tiny (hidden 32, 2 layers, 4 heads, at most 64 tokens): under 0.2 MB and a few
hundredths of a second to build once transformers is imported. The same family, pooling and seed
give the same files in every process (weights and token ids alike).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import Counter
from pathlib import Path

# family -> (transformers model class that saves it, tokenizer kind, what makes it different)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "bert": ("BertModel", "wordpiece", "the reference layout: learned positions from 0, two token types, pooler"),
    "roberta": ("RobertaForMaskedLM", "bytelevel-bpe", "positions from padding_idx + 1, one token type, lm_head"),
    "xlm-roberta": ("XLMRobertaModel", "unigram", "RoBERTa's layout with a sentencepiece-like Unigram vocabulary"),
    "camembert": ("CamembertForMaskedLM", "unigram-camembert", "RoBERTa's layout, CamemBERT's special-token ids"),
    "distilbert": ("DistilBertForMaskedLM", "wordpiece", "own weight names, no token types, no pooler, MLM head"),
    "distilbert-sinusoidal": ("DistilBertModel", "wordpiece", "DistilBERT with sinusoidal_pos_embds=True"),
    "electra": ("ElectraForPreTraining", "wordpiece", "discriminator: embedding_size 16 projected to hidden 32"),
    "mpnet": ("MPNetForMaskedLM", "unigram", "relative-position buckets on every layer's scores, positions from 2, "
              "no token types, lm_head"),
    "modernbert": ("ModernBertForMaskedLM", "wordpiece", "no position table: RoPE with a global and a local base, "
                   "a sliding window of 4 each way on layer 1, pre-norm without biases, GeGLU, fused Wqkv, MLM head"),
    "gte": ("GteForMaskedLM", "unigram", "no position table: RoPE (base 160000), post-norm, GeGLU without biases on "
            "its gate and up projections, one token type, lm_head"),
    "nomic": ("NomicBertForMaskedLM", "wordpiece", "no position table: RoPE (base 1000), post-norm, SwiGLU, no linear "
              "biases, two token types, MLM head"),
    "gemma3": ("Gemma3ForCausalLM", "bytelevel-bpe", "EmbeddingGemma's: bidirectional, a window of 4 each way on "
               "layer 0, two RoPE bases, GQA, QK-norm, RMSNorm (1 + w) before and after each sub-layer, GeGLU (tanh), "
               "embeddings times sqrt(hidden), no biases"),
    "qwen3": ("Qwen3ForCausalLM", "bytelevel-eos", "a decoder embedder: causal mask, GQA (4 query heads on 2), head_dim "
              "16 apart from hidden / heads, QK-RMSNorm, RoPE, SwiGLU, no biases, an EOS appended, lm_head"),
}
# families whose sentence-transformers model pools otherwise by default (a decoder: its last token, the EOS)
DEFAULT_POOLING = {"qwen3": "lasttoken"}
# family -> the transformers class of its sequence classifier (make_classifier)
CLASSIFIERS: dict[str, str] = {
    "bert": "BertForSequenceClassification",
    "roberta": "RobertaForSequenceClassification",
    "xlm-roberta": "XLMRobertaForSequenceClassification",
    "camembert": "CamembertForSequenceClassification",
    "distilbert": "DistilBertForSequenceClassification",
    "distilbert-sinusoidal": "DistilBertForSequenceClassification",
    "electra": "ElectraForSequenceClassification",
    "mpnet": "MPNetForSequenceClassification",
    "modernbert": "ModernBertForSequenceClassification",  # pools the mean (classifier_pooling), a norm in its head
    "gte": "GteForSequenceClassification",
    "nomic": "NomicBertForSequenceClassification",
}
# ModernBERT's local layers see this many tokens each way (local_attention // 2): test texts run past it
MODERNBERT_WINDOW = 4
TOKEN_TYPES = ("bert", "electra", "nomic")  # families whose tokenizer marks a pair's second text (segment 1)
POOLINGS = ("mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
MAX_TOKENS = 64  # the longest input, special tokens included

_HIDDEN, _LAYERS, _HEADS, _FFN = 32, 2, 4, 64
# The weights' standard deviation (config.json's initializer_range; transformers' default is 0.02). At 0.02 a
# tiny model is nearly linear and blind to what the tests claim to hold: swapping ModernBERT's global and local
# RoPE bases moved its pooled embeddings by 2.2e-6, GTE's base 160000 -> 10000 by 1.8e-5, MPNet's relative bias
# zeroed by 2.1e-4, all near or under the tests' 1e-4. At 0.2 they move them by 2.8e-2, 2.4e-1 and 1.3e-1
# while the export stays within 1.4e-6 of sentence-transformers (tests/test_families.py's mutation test holds both).
INIT_STD = 0.2

# Varied text in several scripts, so every tokenizer learns more than one alphabet.
CORPUS = (
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "A man is playing a guitar on the stage while the crowd sings along.",
    "The new movie is awesome, I loved every minute of it!",
    "How do I reset my password if I no longer have access to my email?",
    "Standard shipping takes three to five business days after dispatch.",
    "Refunds are issued to the original payment method within fourteen days.",
    "Paris is the capital and largest city of France.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Rain is expected tomorrow afternoon with temperatures around twelve degrees.",
    "Error: connection refused while contacting the database after three retries.",
    "def add(a, b): return a + b",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name;",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Der Zug nach München fährt um acht Uhr ab.",
    "Le renard brun rapide saute par-dessus le chien paresseux, n'est-ce pas ?",
    "La tour Eiffel est illuminée chaque soir et attire des millions de visiteurs.",
    "El pedido llegó incompleto y todavía no he recibido respuesta del vendedor.",
    "Il museo è chiuso il lunedì e nei giorni festivi.",
    "Быстрая коричневая лиса перепрыгивает через ленивую собаку.",
    "Москва — столица России.",
    "敏捷的棕色狐狸跳过了懒狗。",
    "東京は日本の首都です。このレストランの料理はとても美味しかったです。",
    "مرحبا بالعالم",
    "Hello, world! 🙂 ok",
) * 3


def make_checkpoint(family: str, out: Path, pooling: str = "mean", seed: int = 0, normalize: bool = False,
                    prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
                    include_prompt: bool = True, pooling_format: str = "legacy", config_extra: dict | None = None,
                    init_std: float = INIT_STD) -> Path:
    """Write a small random checkpoint of `family` (a key of FAMILIES) into `out`; return `out`.

    pooling: sentence-transformers' pooling mode (one of POOLINGS); normalize: add its Normalize
    module. prompts, default_prompt_name: config_sentence_transformers.json's; include_prompt: the
    Pooling module's; pooling_format: its config as sentence-transformers 6 writes it ("v6":
    `pooling_mode`) or as older versions did ("legacy": a boolean per mode); config_extra: keys added
    to config.json (matryoshka_dimensions); init_std: the weights' standard deviation (INIT_STD). Needs torch
    and transformers (the export extra), not the network.
    """
    import torch
    import transformers
    from tokenizers import Tokenizer

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: expected one of {', '.join(FAMILIES)}")
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}: expected one of {', '.join(POOLINGS)}")
    class_name, tokenizer_kind, _ = FAMILIES[family]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json, names = _tokenizer(tokenizer_kind)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    specials = {role: tokenizer.token_to_id(token) for role, token in names.items()}
    config = _config(family, vocab_size=tokenizer.get_vocab_size(), specials=specials)
    config.initializer_range = init_std
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        model = getattr(transformers, class_name)(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    if config_extra:
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**raw, **config_extra}, indent=2))
    _write_tokenizer(out, tokenizer_json, names, token_types=family in TOKEN_TYPES)
    _write_sentence_transformers(out, pooling, normalize, include_prompt, pooling_format)
    if prompts is not None:
        (out / "config_sentence_transformers.json").write_text(json.dumps(
            {"prompts": prompts, "default_prompt_name": default_prompt_name, "similarity_fn_name": "cosine"}, indent=2))
    return out


def classifier_labels(num_labels: int) -> list[str]:
    """The id2label names make_classifier writes, in id order."""
    return [f"label_{i}" for i in range(num_labels)]


def make_classifier(family: str, out: Path, num_labels: int, problem_type: str | None = None, seed: int = 0,
                    max_tokens: int = MAX_TOKENS) -> Path:
    """Write a small random <Family>ForSequenceClassification checkpoint of `family` into `out`; return `out`.

    As make_checkpoint, with transformers' classifier class, an id2label of `num_labels` names
    (classifier_labels), problem_type in config.json when given, `max_tokens` positions (a
    cross-encoder of 512 reaches the service's token budget with explain), and no sentence-transformers
    embedding modules: sentence-transformers' CrossEncoder loads it as it is. The head's weights are
    drawn wider than transformers' init (std 0.02 leaves tanh nearly linear and every logit near 0),
    so that a wrong activation, a missing bias or swapped layers move the logits by far more than
    the tests' tolerances.
    """
    import torch
    import transformers
    from tokenizers import Tokenizer

    if family not in CLASSIFIERS:
        raise ValueError(f"unknown family {family!r}: expected one of {', '.join(CLASSIFIERS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json, names = _tokenizer(FAMILIES[family][1])
    tokenizer = Tokenizer.from_str(tokenizer_json)
    config = _config(family, vocab_size=tokenizer.get_vocab_size(),
                     specials={role: tokenizer.token_to_id(token) for role, token in names.items()}, max_tokens=max_tokens)
    config.id2label = dict(enumerate(classifier_labels(num_labels)))
    config.label2id = {label: i for i, label in config.id2label.items()}
    config.problem_type = problem_type
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, CLASSIFIERS[family])(config).eval()
        base = model.base_model_prefix + "."
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if not name.startswith(base) or ".pooler." in name:  # the head (BERT's pooler is part of it)
                    parameter.normal_(std=0.3)
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out, tokenizer_json, names, token_types=family in TOKEN_TYPES, max_tokens=max_tokens)
    return out


def _config(family: str, vocab_size: int, specials: dict[str, int], max_tokens: int = MAX_TOKENS):
    """The transformers config of a tiny model of `family`."""
    import transformers

    bert_like = dict(
        vocab_size=vocab_size, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
        intermediate_size=_FFN, pad_token_id=specials["pad"],
    )
    if family == "bert":
        return transformers.BertConfig(**bert_like, max_position_embeddings=max_tokens)
    if family in ("roberta", "xlm-roberta", "camembert"):
        config_class = {
            "roberta": transformers.RobertaConfig,
            "xlm-roberta": transformers.XLMRobertaConfig,
            "camembert": transformers.CamembertConfig,
        }[family]
        # positions run from pad_token_id + 1, so the table holds pad_token_id + 1 more rows
        return config_class(
            **bert_like, max_position_embeddings=max_tokens + specials["pad"] + 1, type_vocab_size=1,
            bos_token_id=specials["bos"], eos_token_id=specials["eos"],
        )
    if family.startswith("distilbert"):
        return transformers.DistilBertConfig(
            vocab_size=vocab_size, dim=_HIDDEN, n_layers=_LAYERS, n_heads=_HEADS, hidden_dim=_FFN,
            max_position_embeddings=max_tokens, pad_token_id=specials["pad"],
            sinusoidal_pos_embds=family == "distilbert-sinusoidal",
        )
    if family == "electra":
        return transformers.ElectraConfig(**bert_like, embedding_size=16, max_position_embeddings=max_tokens)
    if family == "qwen3":
        return transformers.Qwen3Config(
            vocab_size=vocab_size, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
            num_key_value_heads=_HEADS // 2, head_dim=16, intermediate_size=_FFN, max_position_embeddings=max_tokens,
            pad_token_id=specials["pad"], eos_token_id=specials["eos"], bos_token_id=None, rope_theta=1000.0,
            tie_word_embeddings=False)
    if family == "modernbert":  # layer 0 global, layer 1 local; classifiers pool the mean
        return transformers.ModernBertConfig(
            vocab_size=vocab_size, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
            intermediate_size=_FFN, max_position_embeddings=max_tokens, pad_token_id=specials["pad"],
            bos_token_id=specials["cls"], eos_token_id=specials["sep"], cls_token_id=specials["cls"],
            sep_token_id=specials["sep"], global_attn_every_n_layers=2, local_attention=2 * MODERNBERT_WINDOW,
            global_rope_theta=160_000.0, local_rope_theta=10_000.0, classifier_pooling="mean")
    if family == "gemma3":  # layer 0 local (sliding_window 8: 4 each way when bidirectional), layer 1 global
        return transformers.Gemma3TextConfig(
            vocab_size=vocab_size, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
            num_key_value_heads=_HEADS // 2, head_dim=16, query_pre_attn_scalar=16, intermediate_size=_FFN,
            max_position_embeddings=max_tokens, sliding_window=2 * MODERNBERT_WINDOW,
            layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention=True,
            pad_token_id=specials["pad"], bos_token_id=specials["bos"], eos_token_id=specials["eos"])
    if family == "gte":
        return transformers.GteConfig(**bert_like, max_position_embeddings=max_tokens, type_vocab_size=1)
    if family == "nomic":
        return transformers.NomicBertConfig(**bert_like, max_position_embeddings=max_tokens)
    if family == "mpnet":  # padding_idx is 1 in MPNet's code: the Unigram tokenizer's <pad> is 1 too
        assert specials["pad"] == 1, specials
        return transformers.MPNetConfig(**bert_like, max_position_embeddings=max_tokens + 2,
                                        relative_attention_num_buckets=32, bos_token_id=specials["bos"],
                                        eos_token_id=specials["eos"])
    raise AssertionError(family)


def _words(normalizer, pre_tokenizer) -> Counter:
    """How often each pre-tokenized word of CORPUS occurs, after the tokenizer's own normalizer."""
    counts: Counter = Counter()
    for text in CORPUS:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    return counts


@functools.lru_cache(maxsize=None)
def _tokenizer(kind: str) -> tuple[str, dict[str, str]]:
    """A tokenizer of `kind` for CORPUS: (its JSON, special tokens by role: pad, unk, bos, eos, mask, ...).

    Deterministic, so that a checkpoint's token ids are the same in every process: the vocabularies
    of WordPiece and Unigram are built here from word and character counts (their trainers break
    ties differently from run to run); byte-level BPE comes from its trainer, which is stable.
    """
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE, Unigram, WordPiece

    if kind == "wordpiece":  # BERT, DistilBERT, ELECTRA: [CLS] $A [SEP]
        names = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
        normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
        counts = _words(normalizer, pre_tokenizer)
        chars = sorted({c for word in counts for c in word})
        words = [w for w, _ in sorted(counts.items(), key=lambda wc: (-wc[1], wc[0])) if len(w) > 1][:250]
        pieces = [*names.values(), *chars, *(f"##{c}" for c in chars), *words]
        tokenizer = Tokenizer(WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
        tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
        tokenizer.decoder = decoders.WordPiece()
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("[CLS]", "[SEP]")],
        )
        names |= {"bos": "[CLS]", "eos": "[SEP]"}
    elif kind == "bytelevel-bpe":  # RoBERTa: GPT-2's byte-level BPE, <s> $A </s>
        names = {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>", "mask": "<mask>"}
        tokenizer = Tokenizer(BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=700, special_tokens=list(names.values()), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(CORPUS, trainer)
        tokenizer.post_processor = processors.RobertaProcessing(
            ("</s>", tokenizer.token_to_id("</s>")), ("<s>", tokenizer.token_to_id("<s>")),
            trim_offsets=True, add_prefix_space=False,
        )
    elif kind == "bytelevel-eos":  # Qwen's: byte-level BPE, no BOS, <|endoftext|> appended (the EOS pooled)
        names = {"eos": "<|endoftext|>", "pad": "<|endoftext|>", "unk": "<unk>", "mask": "<mask>"}
        tokenizer = Tokenizer(BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=700, special_tokens=["<|endoftext|>", "<unk>", "<mask>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tokenizer.train_from_iterator(CORPUS, trainer)
        eos = tokenizer.token_to_id("<|endoftext|>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
            special_tokens=[("<|endoftext|>", eos)])
    elif kind in ("unigram", "unigram-camembert"):  # XLM-R, CamemBERT: sentencepiece Unigram, <s> $A </s>
        names = {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>", "mask": "<mask>"}
        if kind == "unigram":  # XLM-R's fairseq order: <s> <pad> </s> <unk>, <mask> last
            specials = ["<s>", "<pad>", "</s>", "<unk>"]
        else:  # CamemBERT's: unused <s>NOTUSED / </s>NOTUSED at 0 and 2, the real <s> </s> at 5 and 6
            specials = ["<s>NOTUSED", "<pad>", "</s>NOTUSED", "<unk>", "<unused>", "<s>", "</s>"]
        normalizer = normalizers.NFKC()
        pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        counts: Counter = Counter()  # words split from their punctuation: "▁world!" -> "▁world", "!"
        for word, n in _words(normalizer, pre_tokenizer).items():
            counts.update({piece: n for piece in re.findall(r"▁?\w+|[^\w▁]+|▁", word)})
        chars: Counter = Counter()
        for word, n in counts.items():
            chars.update({c: n for c in word})
        # log-probabilities: whole words (their own counts) beat spelling them out character by character
        total_words, total_chars = sum(counts.values()), sum(chars.values())
        scored = [(w, round(math.log(n / total_words), 6)) for w, n in counts.items() if len(w) > 1]
        scored += [(c, round(math.log(n / total_chars) - 2.0, 6)) for c, n in chars.items()]
        scored.sort(key=lambda ps: (-ps[1], ps[0]))
        vocab = [(t, 0.0) for t in specials] + scored[:330] + [("<mask>", 0.0)]
        tokenizer = Tokenizer(Unigram(vocab, unk_id=specials.index("<unk>"), byte_fallback=False))
        tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("<s>", "</s>")],
        )
    else:
        raise AssertionError(kind)
    tokenizer.add_special_tokens([t for t in names.values()])  # never split, skipped when decoding
    return tokenizer.to_str(), names


def _write_tokenizer(out: Path, tokenizer_json: str, names: dict[str, str], token_types: bool,
                     max_tokens: int = MAX_TOKENS) -> None:
    """tokenizer.json, and a tokenizer_config.json naming the generic fast class so that
    transformers and sentence-transformers use exactly tokenizer.json (a model-specific class
    would re-derive normalizer and post-processor settings of its own)."""
    (out / "tokenizer.json").write_text(tokenizer_json)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_tokens,
        "padding_side": "right",
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"] if token_types
        else ["input_ids", "attention_mask"],
        "pad_token": names["pad"],
        "unk_token": names["unk"],
        "mask_token": names["mask"],
    }
    if "cls" in names or "bos" in names:  # a decoder's tokenizer (Qwen's) has neither
        config |= {"cls_token": names.get("cls") or names["bos"], "sep_token": names.get("sep") or names["eos"]}
    if "bos" in names:
        config |= {"bos_token": names["bos"], "eos_token": names["eos"]}
    elif "eos" in names:
        config |= {"eos_token": names["eos"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _write_sentence_transformers(out: Path, pooling: str, normalize: bool, include_prompt: bool = True,
                                 pooling_format: str = "legacy") -> None:
    """modules.json (Transformer, Pooling, optional Normalize), the Pooling config, max_seq_length."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_TOKENS, "do_lower_case": False}))
    (out / "1_Pooling").mkdir(exist_ok=True)
    if pooling_format == "v6":
        config = {"embedding_dimension": _HIDDEN, "pooling_mode": pooling, "include_prompt": include_prompt}
    else:
        config = {
            "word_embedding_dimension": _HIDDEN,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": pooling == "max",
            "pooling_mode_mean_sqrt_len_tokens": pooling == "mean_sqrt_len_tokens",
            "pooling_mode_weightedmean_tokens": pooling == "weightedmean",
            "pooling_mode_lasttoken": pooling == "lasttoken",
            "include_prompt": include_prompt,
        }
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))


def add_dense(checkpoint: Path, out: Path, seed: int = 7, like: str = "distiluse",
              prompts: dict[str, str] | None = None) -> Path:
    """`checkpoint` with two sentence-transformers Dense modules after its pooling, then Normalize; saved
    by sentence-transformers itself into `out`. like "distiluse": Tanh to 24 wide, then a linear map to 16
    without bias; "embeddinggemma": linear maps without bias or activation out to 1.5x the width and
    back, as EmbeddingGemma's 768 -> 3072 -> 768. prompts: saved with the model."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense, Normalize

    base = SentenceTransformer(str(checkpoint), device="cpu")
    hidden = base.get_sentence_embedding_dimension()
    identity = torch.nn.Identity()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if like == "distiluse":
            dense = [Dense(hidden, 24, activation_function=torch.nn.Tanh()),
                     Dense(24, 16, bias=False, activation_function=identity)]
        else:
            wide = hidden * 3 // 2
            dense = [Dense(hidden, wide, bias=False, activation_function=identity),
                     Dense(wide, hidden, bias=False, activation_function=identity)]
        modules = [base[0], base[1], *dense, Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(out))
    return Path(out)


def native_layout(checkpoint: Path, out: Path) -> Path:
    """`checkpoint` with its weights under transformers 5's own names (the model's state_dict: `layers.N.
    self_attn.q_proj`, ...) instead of the original layout save_pretrained writes back for GTE and NomicBert
    (`encoder.layer.N.attention.qkv_proj`, `attn.Wqkv`, ...): a checkpoint saved by other tools."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    out = Path(shutil.copytree(checkpoint, out))
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(str(checkpoint))
    save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
