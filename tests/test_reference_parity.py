"""Our encoder loaded with all-MiniLM-L6-v2 against the reference implementations:
sentence-transformers (embeddings) and transformers' BertModel (hidden states, attentions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

TEXTS = [
    "A man is playing a guitar on the stage.",
    "The new movie is awesome, I loved every minute of it!",
    "Der Zug nach München fährt um acht Uhr ab.",
    "La tour Eiffel est illuminée chaque soir.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "مرحبا بالعالم",
    "",  # empty-ish: only [CLS] [SEP]
    " ",
    ".",
    "🙂",
    " ".join(["longer text that goes past the model's maximum of 256 tokens"] * 40),  # truncated
]


@pytest.fixture(scope="module")
def tokenized(checkpoint):
    tokenizer = Tokenizer.from_file(str(checkpoint.tokenizer_path))
    tokenizer.enable_truncation(checkpoint.max_tokens)
    tokenizer.enable_padding(pad_id=0)
    enc = tokenizer.encode_batch(TEXTS)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.long)  # noqa: E731
    return (
        as_tensor([e.ids for e in enc]),
        as_tensor([e.attention_mask for e in enc]),
        as_tensor([e.type_ids for e in enc]),
    )


@pytest.fixture(scope="module")
def ours(checkpoint, tokenized):
    with torch.no_grad():
        return checkpoint.encoder(*tokenized)


def test_batch_covers_max_length_and_minimal_inputs(tokenized, checkpoint):
    lengths = tokenized[1].sum(1)
    assert lengths.max().item() == checkpoint.max_tokens == 256
    assert lengths.min().item() == 2  # "" is [CLS] [SEP]


def test_embeddings_match_sentence_transformers(checkpoint, ours):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(checkpoint.path), device="cpu")
    assert st.max_seq_length == checkpoint.max_tokens
    reference = st.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    cosine = torch.nn.functional.cosine_similarity(ours[1], reference)
    assert cosine.min().item() >= 0.99999, cosine.tolist()
    # sentence-transformers normalises, so do we: the vectors themselves agree, not only directions
    torch.testing.assert_close(ours[1], reference, atol=1e-5, rtol=1e-4)


def test_hidden_states_and_attentions_match_transformers(checkpoint, tokenized, ours):
    from transformers import BertModel

    bert = BertModel.from_pretrained(str(checkpoint.path), attn_implementation="eager").eval()
    input_ids, mask, types = tokenized
    with torch.no_grad():
        ref = bert(input_ids=input_ids, attention_mask=mask, token_type_ids=types, output_attentions=True)
    real = mask.bool()
    hidden_diff = (ours[0][real] - ref.last_hidden_state[real]).abs().max().item()
    assert hidden_diff <= 1e-4, hidden_diff

    ref_attn = torch.stack(ref.attentions)  # (layers, B, heads, T, T)
    assert ours[2].shape == ref_attn.shape
    pairs = real[:, :, None] & real[:, None, :]  # real query and real key
    ours_real = ours[2].permute(1, 3, 4, 0, 2)[pairs]
    ref_real = ref_attn.permute(1, 3, 4, 0, 2)[pairs]
    attn_diff = (ours_real - ref_real).abs().max().item()
    assert attn_diff <= 1e-4, attn_diff
    # every real query's weights over real keys sum to 1: nothing leaks onto padding
    sums = (ours[2] * real[None, :, None, None, :]).sum(-1).permute(1, 3, 0, 2)[real]  # (n_real, layers, heads)
    assert np.allclose(sums.numpy(), 1.0, atol=1e-5)
