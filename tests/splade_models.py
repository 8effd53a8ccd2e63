"""Small random SPLADE checkpoints, built offline with transformers' and sentence-transformers' own classes.

    from tests.splade_models import make_masked_lm, make_sparse_encoder
    mlm = make_masked_lm("bert", tmp_path / "bert-mlm")  # a bare BertForMaskedLM (export with --pooling splade)
    path = make_sparse_encoder("xlm-roberta", tmp_path / "splade", pooling="sum")  # SparseEncoder(...).save

The encoders are tests/families.py's tiny ones (hidden 32, 2 layers, vocabularies of a few hundred entries, 64
tokens) with their family's *ForMaskedLM head; every bias and norm is drawn away from transformers' zeros and
ones, so that a head computed without its bias or norm moves the logits by far more than the tests' tolerance.
"""

from __future__ import annotations

from pathlib import Path

from tests.families import FAMILIES, INIT_STD, TOKEN_TYPES, _config, _tokenizer, _write_tokenizer

# family -> the transformers class of its masked-LM model
MASKED_LM_CLASSES = {
    "bert": "BertForMaskedLM",
    "roberta": "RobertaForMaskedLM",
    "xlm-roberta": "XLMRobertaForMaskedLM",
    "distilbert": "DistilBertForMaskedLM",
    "mpnet": "MPNetForMaskedLM",
    "modernbert": "ModernBertForMaskedLM",
    "electra": "ElectraForMaskedLM",  # a head the encoder does not compute: refused
}


def make_masked_lm(family: str, out: Path, seed: int = 0, tie_word_embeddings: bool = True) -> Path:
    """A bare <Family>ForMaskedLM (config.json, model.safetensors, tokenizer.json; no sentence-transformers
    files) written into `out` by transformers' save_pretrained; return `out`."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json, names = _tokenizer(FAMILIES[family][1])
    tokenizer = Tokenizer.from_str(tokenizer_json)
    config = _config(family, vocab_size=tokenizer.get_vocab_size(),
                     specials={role: tokenizer.token_to_id(token) for role, token in names.items()})
    config.initializer_range = INIT_STD
    config.tie_word_embeddings = tie_word_embeddings
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, MASKED_LM_CLASSES[family])(config).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() == 1:  # biases and norms: away from 0 and 1
                    parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out, tokenizer_json, names, token_types=family in TOKEN_TYPES)
    return out


def make_sparse_encoder(family: str, out: Path, pooling: str = "max", module: str = "MLMTransformer",
                        seed: int = 0) -> Path:
    """A sentence-transformers SparseEncoder saved into `out`: the family's masked-LM model (make_masked_lm, in
    `out`-mlm) then SpladePooling(`pooling`: max or sum). module: "MLMTransformer" (the module sentence-
    transformers 5 saved SPLADE models with) or "Transformer" (6's: transformer_task fill-mask)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling, Transformer

    out = Path(out)
    mlm = make_masked_lm(family, out.with_name(out.name + "-mlm"), seed)
    first = MLMTransformer(str(mlm)) if module == "MLMTransformer" else Transformer(str(mlm),
                                                                                   transformer_task="fill-mask")
    SparseEncoder(modules=[first, SpladePooling(pooling_strategy=pooling)], device="cpu").save(str(out))
    return out
