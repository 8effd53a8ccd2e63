"""EncoderConfig: every hyper-parameter of the encoder, with the reason for each default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bundle.manifest import SPLADE_POOLINGS, Pooling, ScoreActivation

Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
# what a sentence-transformers Dense module applies after its linear map
DenseActivation = Literal["identity", "tanh", "relu", "gelu", "sigmoid"]
# rotary: no table; queries and keys are rotated by their positions in every layer (RoPE)
PositionKind = Literal["learned", "sinusoidal", "rotary"]
NormKind = Literal["layernorm", "rmsnorm"]
# what a sequence-classification head applies after its dense layer (BERT's pooler and RoBERTa: tanh,
# DistilBERT: ReLU, ELECTRA: exact GELU)
HeadActivation = Literal["tanh", "relu", "gelu"]
ProblemType = Literal["single_label_classification", "multi_label_classification", "regression"]


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module after pooling: activation(W x + b), plus x (or a projection
    of x) with use_residual. distiluse-style models project the pooled embedding this way."""

    in_features: int
    out_features: int
    bias: bool = True
    activation: DenseActivation = "tanh"  # sentence-transformers' default
    residual: bool = False


@dataclass(frozen=True)
class ClassifierConfig:
    """A *ForSequenceClassification head: out_proj(activation(dense(h_first))), dropout on the way in
    training. Every family we load has this shape; they differ in activation, dropout and weight names."""

    labels: tuple[str, ...]  # config.json's id2label in id order: one per logit
    problem_type: ProblemType
    activation: HeadActivation
    dropout: float = 0.1  # before out_proj, training only
    input_dropout: bool = False  # RoBERTa and ELECTRA also drop the first token's encoding before dense
    score_activation: ScoreActivation = "sigmoid"  # CrossEncoder.predict's activation_fn on the logits (not in the graph)
    dense_bias: bool = True  # ModernBERT's head dense has none (classifier_bias false)
    norm: bool = False  # a norm (the encoder's kind) after the activation: ModernBERT's prediction head

    def __post_init__(self) -> None:
        if not self.labels:
            raise ValueError("a classifier needs at least one label")

    @property
    def num_labels(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class MaskedLMConfig:
    """A *ForMaskedLM head: decoder(norm(activation(dense(h)))) per token, vocab_size logits (what a SPLADE
    model pools). The norm is the encoder's kind and eps in every family we load."""

    activation: Activation
    dense_bias: bool = True  # ModernBERT's dense has none (classifier_bias false)
    decoder_bias: bool = True  # ModernBERT's decoder_bias may say none
    tied: bool = True  # the decoder's weight is the word embeddings (config.json's tie_word_embeddings)


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 30522  # BERT's WordPiece vocabulary
    d_model: int = 384  # all-MiniLM-L6-v2's hidden size
    n_layers: int = 6
    n_heads: int = 12  # d_k = 384 / 12 = 32
    d_ff: int = 1536  # 4 x d_model, as in BERT
    max_positions: int = 512  # BERT's learned position table
    type_vocab_size: int = 2  # segments A/B; 0 means no segment embedding
    layer_norm_eps: float = 1e-12  # BERT's value; torch's default 1e-5 would drift from checkpoints
    dropout: float = 0.1  # on embeddings and sub-layer outputs, training only
    attention_dropout: float = 0.1  # on attention weights, training only
    activation: Activation = "gelu"  # BERT uses the exact (erf) GELU
    position_kind: PositionKind = "learned"  # BERT checkpoints learn positions; sinusoidal for new models
    norm_first: bool = False  # post-norm as in BERT; pre-norm trains more stably when deep
    pooling: Pooling = "mean"  # sentence-transformers' choice for MiniLM
    normalize: bool = False  # L2-normalise the pooled embedding
    pad_token_id: int = 0
    # 0: token i sits at position i (BERT). k > 0: real tokens are counted over the attention
    # mask from k and padding sits at k - 1 (RoBERTa's padding_idx + 1, fairseq's make_positions).
    position_offset: int = 0
    # Width of the token/position/segment embeddings, projected up to d_model after their
    # LayerNorm when it differs (ELECTRA's embedding_size); None means d_model.
    embedding_size: int | None = None
    # Token embeddings are multiplied by this before positions are added. None: sqrt(width) with
    # sinusoidal positions ("Attention Is All You Need" keeps the fixed [-1, 1] signal from
    # drowning them), 1 with learned ones. DistilBERT adds its sinusoidal table unscaled: 1.0.
    embedding_scale: float | None = None
    # Dense projections of the pooled embedding, in order, before normalisation (sentence-transformers'
    # Dense modules); the sentence embedding then has the last one's out_features.
    dense: tuple[DenseLayer, ...] = ()
    # Relative positions (MPNet, after T5): rows of a (rows, n_heads) table of biases added to every
    # layer's attention scores, picked by the bucket of key position - query position; 0: none.
    relative_buckets: int = 0
    # how relative distances fall into buckets: half the buckets per direction, exact up to a
    # quarter, logarithmic up to max_distance (transformers' MPNet always buckets with 32 and 128)
    relative_bucketing: int = 32
    relative_max_distance: int = 128
    # The choices of newer families (../shared/DESIGN.md, "Families as blocks"):
    n_kv_heads: int | None = None  # grouped-query attention: key/value heads shared by n_heads / n_kv_heads queries
    head_dim: int | None = None  # per-head width when it is not d_model / n_heads (Qwen3)
    rope_theta: float = 10000.0  # the rotary base, with position_kind "rotary"
    norm: NormKind = "layernorm"  # RMSNorm: x / rms(x) * w, no centring, no bias (Llama, Qwen)
    norm_weight_offset: float = 0.0  # RMSNorm scales by offset + w: Gemma stores w around 0 and scales by 1 + w
    post_sublayer_norm: bool = False  # pre-norm plus a norm on each sub-layer's output before the residual (Gemma)
    qk_norm: bool = False  # a norm over each head's queries and keys before the rotation (Qwen3)
    bias: bool = True  # biases on the attention and feed-forward projections
    gated_mlp: bool = False  # down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu
    gate_bias: bool | None = None  # biases on the gate and up projections (None: as `bias`; GTE has none there)
    causal: bool = False  # a token attends only to itself and the tokens before it (decoder embedders)
    embedding_norm: bool = True  # a norm after the embeddings (BERT's; decoders have none)
    norm_bias: bool = True  # LayerNorm with a bias (ModernBERT's has none)
    # the first layer attends its input as it is (ModernBERT: the embeddings are normed already), pre-norm only
    first_attention_norm: bool = True
    # Local attention (ModernBERT, Gemma 3): in the layers listed, a query attends only the keys at most
    # sliding_window positions away, and RoPE turns them by local_rope_theta (None: rope_theta)
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")
        if self.position_kind == "rotary" and self.d_k % 2 != 0:
            raise ValueError(f"rotary positions need an even head width, got {self.d_k}")
        if self.position_kind == "sinusoidal" and self.d_embed % 2 != 0:
            raise ValueError(f"sinusoidal positions need an even embedding width, got {self.d_embed}")
        if self.embedding_size is not None and self.embedding_size <= 0:
            raise ValueError(f"embedding_size must be positive, got {self.embedding_size}")
        if self.sliding_layers and (self.sliding_window <= 0 or not all(0 <= i < self.n_layers for i in self.sliding_layers)):
            raise ValueError(f"sliding layers {list(self.sliding_layers)} need a positive window and indexes below "
                             f"{self.n_layers}, got window {self.sliding_window}")
        width = self.d_model
        for i, layer in enumerate(self.dense):
            if layer.in_features != width:
                raise ValueError(f"dense layer {i} takes {layer.in_features} features, the embedding before it has {width}")
            width = layer.out_features
        if not 0 <= self.position_offset < self.max_positions:
            raise ValueError(
                f"position_offset {self.position_offset} leaves no room in {self.max_positions} positions"
            )

    @property
    def d_k(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def sentence_dim(self) -> int:
        """Size of the sentence embedding: d_model, or the last Dense layer's output; a SPLADE model's pooled
        output has one weight per vocabulary entry."""
        if self.pooling in SPLADE_POOLINGS:
            return self.vocab_size
        return self.dense[-1].out_features if self.dense else self.d_model

    @property
    def d_embed(self) -> int:
        """Width of the embedding tables (d_model unless the checkpoint projects them)."""
        return self.embedding_size or self.d_model

    @property
    def max_sequence_length(self) -> int:
        """The longest input the position table covers, in tokens."""
        return self.max_positions - self.position_offset
