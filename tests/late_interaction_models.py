"""Small random late-interaction checkpoints in the layouts their libraries save, built offline.

    from tests.late_interaction_models import make_bge_m3, make_pylate_colbert
    make_bge_m3(tmp_path / "bge-m3")          # BAAI/bge-m3's layout: XLM-R + CLS + Normalize + the two .pt heads
    make_pylate_colbert(tmp_path / "colbert")  # what PyLate 1.6's ColBERT.save writes

Both start from tests/families.py's tiny checkpoints (hidden 32, 2 layers, 64 tokens). PyLate itself cannot be
installed beside sentence-transformers 6 (it pins 5.3), so the ColBERT layout is written here file by file as
PyLate 1.6 saves it (pylate/models/colbert.py's save, Dense.py's get_config_dict), the markers added to the
tokenizer and the embeddings resized with transformers' own calls, as PyLate's ColBERT.__init__ does.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tests.families import make_checkpoint

COLBERT_DIM = 16
QUERY_LENGTH, DOCUMENT_LENGTH = 12, 40


def make_bge_m3(out: Path, seed: int = 0) -> Path:
    """An XLM-R sentence-transformers model (CLS pooling, Normalize) with FlagEmbedding's `colbert_linear.pt`
    (hidden -> hidden) and `sparse_linear.pt` (hidden -> 1) beside it: torch.save of each nn.Linear's state
    dict, as BGEM3's save writes them."""
    import torch

    out = make_checkpoint("xlm-roberta", Path(out), pooling="cls", normalize=True, seed=seed)
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        colbert, sparse = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 1)
        with torch.no_grad():
            sparse.bias.fill_(0.3)  # most tokens get a weight, some none: both paths of relu are exercised
    torch.save(colbert.state_dict(), out / "colbert_linear.pt")
    torch.save(sparse.state_dict(), out / "sparse_linear.pt")
    return out


def make_pylate_colbert(out: Path, family: str = "bert", seed: int = 0, dim: int = COLBERT_DIM,
                        settings: dict | None = None, dense_config: dict | None = None) -> Path:
    """A PyLate ColBERT: the transformer saved with the `[Q] ` and `[D] ` markers added to its tokenizer (and its
    embeddings resized to them), modules.json with the Transformer and `pylate.models.Dense` (1_Dense: hidden ->
    `dim`, no bias, Identity), no Pooling, and config_sentence_transformers.json with PyLate's settings
    (`settings` overrides them: None values are written as null, as PyLate writes an unset value)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    out = make_checkpoint(family, Path(out), seed=seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModel.from_pretrained(out)
    tokenizer.add_tokens(["[Q] ", "[D] "])  # PyLate: add_tokens(prefix_tokens), then resize_token_embeddings
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    hidden = model.config.hidden_size
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense"}], indent=2))
    for stale in (out / "1_Pooling").glob("*"):
        stale.unlink()
    (out / "1_Pooling").rmdir()
    (out / "1_Dense").mkdir()
    (out / "1_Dense" / "config.json").write_text(json.dumps({
        "in_features": hidden, "out_features": dim, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False, **(dense_config or {})},
        indent=2))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        weight = torch.nn.Linear(hidden, dim, bias=False).weight.detach().clone()
    save_file({"linear.weight": weight}, str(out / "1_Dense" / "model.safetensors"))
    config = {"__version__": {"sentence_transformers": "5.3.0", "transformers": "5.3.0", "pytorch": "2.10.0"},
              "prompts": {}, "default_prompt_name": None, "similarity_fn_name": "MaxSim",
              "query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": QUERY_LENGTH,
              "document_length": DOCUMENT_LENGTH, "attend_to_expansion_tokens": False,
              "skiplist_words": list(string.punctuation), "do_query_expansion": True}
    (out / "config_sentence_transformers.json").write_text(json.dumps(config | (settings or {}), indent=2))
    return out
