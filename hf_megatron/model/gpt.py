"""GPTModel: embedding -> N transformer layers -> final norm -> output layer (-> loss).

Plain PyTorch (nn.Linear, nn.Embedding, norms) under megatron-core's parameter names
(`embedding.word_embeddings.weight`, `decoder.layers.N.self_attention.linear_qkv.weight`, ...,
`decoder.final_layernorm.weight`, `output_layer.weight`).  It knows nothing of process groups:
tensor / sequence parallelism, recompute and pipeline splits are applied from outside
(`hf_megatron.parallel`), by swapping or removing modules by name.  So the forward tolerates
removed parts: a pipeline stage without `embedding` takes `hidden_states`, one without
`output_layer` returns them.  `decoder.layers` is keyed by the *global* layer number.

Shapes: inputs [b, s]; activations [s, b, h] (Megatron's layout: sequence parallelism is a split
of dim 0); logits [b, s, vocab_size].  The vocabulary is padded to a multiple of
`make_vocab_size_divisible_by` (Megatron's rule) and the padding never reaches the loss.

Family options (ModelConfig): word embeddings times `embedding_multiplier` in their own dtype
(Gemma: sqrt(hidden)); per-layer attention types (`layer_types`: sliding-window or full layers,
each type with its own mask and, with `local_rotary_base`, its own RoPE tables); final logits
soft-capped, logits <- c * tanh(logits / c) (Gemma 2), before the loss.

Targets: `labels=` has transformers' meaning (the model shifts: token t is scored against
labels[t + 1]); `targets=` are already aligned (token t against targets[t]), the training
path's form, where the data supplies a window of s + 1 tokens as s inputs and s targets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels.cross_entropy import cross_entropy as fused_cross_entropy
from .attention import build_attention_mask
from .block import TransformerLayer
from .norms import make_norm
from .rotary import RotaryEmbedding

IGNORE_INDEX = -100


@dataclass
class GPTOutput:
    loss: torch.Tensor | None = None  # mean over non-ignored tokens
    logits: torch.Tensor | None = None  # [b, s, vocab_size], padding removed
    loss_sum: torch.Tensor | None = None  # sum of per-token losses (for micro-batch accumulation)
    num_tokens: torch.Tensor | None = None  # number of non-ignored target tokens
    hidden_states: torch.Tensor | None = None  # [s, b, h] output of a stage without output layer


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal shift: targets[t] = labels[t + 1]; the last position is ignored."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


class Embedding(nn.Module):
    """word (+ learned position) embeddings, then dropout: [b, s] ids -> [s, b, h]."""

    def __init__(self, config: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size(), config.hidden_size, dtype=dtype, device=device)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                    dtype=dtype, device=device)
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        self.multiplier = config.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = self.word_embeddings(input_ids.t())
        if self.multiplier != 1.0:  # as transformers' Gemma: the fp32 scalar cast to the table's dtype
            # torch.full, not torch.tensor: a fill on the device, no blocking host-to-GPU copy per step
            out = out * torch.full((), self.multiplier, dtype=torch.float32, device=out.device).to(out.dtype)
        if self.position_embeddings is not None:
            out = out + self.position_embeddings(position_ids.t())
        return self.embedding_dropout(out)


class LayerDict(nn.ModuleDict):
    """Layers keyed by their global number (`layers[5]` or `layers["5"]`), so a pipeline stage
    that holds layers 4..7 keeps their names."""

    def __getitem__(self, key):
        return super().__getitem__(str(key))

    def __delitem__(self, key):
        super().__delitem__(str(key))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.layers = LayerDict({str(i): TransformerLayer(config, dtype=dtype, device=device)
                                 for i in range(config.num_layers)})
        self.final_layernorm = make_norm(config, dtype=dtype, device=device)
        self.layer_type = config.layer_type

    def forward(self, hidden, rotary, mask):
        """`rotary` and `mask` are one value for all layers, or dicts keyed by layer type."""
        for number, layer in self.layers.items():
            kind = self.layer_type(int(number))
            hidden = layer(hidden, rotary[kind] if isinstance(rotary, dict) else rotary,
                           mask[kind] if isinstance(mask, dict) else mask)
        return self.final_layernorm(hidden) if self.final_layernorm is not None else hidden


class OutputLayer(nn.Module):
    """logits = x W^T over the padded vocabulary.  With tied embeddings on a model that also holds
    the embedding, W is the word-embedding table (no weight of its own, as in megatron-core)."""

    def __init__(self, hidden_size: int, padded_vocab: int, tied: bool, dtype=None, device=None):
        super().__init__()
        self.weight = None if tied else nn.Parameter(torch.empty(padded_vocab, hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight if self.weight is not None else tied_weight)


class VocabLoss(nn.Module):
    """Per-token cross entropy over (padded) vocabulary logits, and the unpadded logits.
    Tensor parallelism swaps in the vocab-parallel version (`parallel.loss`)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, keep_logits: bool = True) -> torch.Tensor:
        """logits [s, b, V_padded], targets [s, b] -> fp32 losses [s, b] (0 where ignored).

        On CUDA the fused kernel of kernels/cross_entropy.py; `keep_logits=False` (the caller does not
        use the logits after this) lets its backward write the gradient into the logits' buffer."""
        return fused_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.vocab_size, IGNORE_INDEX,
                                     grad_into_logits=not keep_logits).view(targets.shape)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., : self.vocab_size]


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config, dtype=dtype, device=device)
        self.rotary = self.local_rotary = None
        if config.position_embedding_type == "rope":
            rotary_dim = int(config.kv_channels * config.rotary_percent)
            self.rotary = RotaryEmbedding(rotary_dim, config.rotary_base, config.rope_scaling)
            if config.local_rotary_base is not None:  # sliding layers: their own base, unscaled
                self.local_rotary = RotaryEmbedding(rotary_dim, config.local_rotary_base)
        self.decoder = Decoder(config, dtype=dtype, device=device)
        self.output_layer = OutputLayer(config.hidden_size, config.padded_vocab_size(), config.tie_word_embeddings,
                                        dtype=dtype, device=device)
        self.vocab_loss = VocabLoss(config.vocab_size)

    # what a pipeline split hands to the first / last stage; layers go in between
    FIRST_STAGE_MODULES = ("embedding",)
    LAST_STAGE_MODULES = ("decoder.final_layernorm", "output_layer", "vocab_loss")
    LAYERS = "decoder.layers"

    # ------------------------------------------------------------------ structure
    @property
    def pre_process(self) -> bool:
        return self.embedding is not None

    @property
    def post_process(self) -> bool:
        return self.output_layer is not None

    @property
    def layer_numbers(self) -> list[int]:
        """Global numbers of the layers this model (or pipeline stage) holds."""
        return [int(key) for key in self.decoder.layers.keys()]

    # ------------------------------------------------------------------ forward
    def _rotary_and_mask(self, position_ids, dtype, attention_mask, s, device):
        """RoPE tables and attention mask: one each, or (with `layer_types`) dicts by layer type."""
        config = self.config
        rotary = self.rotary(position_ids, dtype) if self.rotary is not None else None
        if config.layer_types is None:
            return rotary, build_attention_mask(s, attention_mask, config.sliding_window, device)
        mask = {"full_attention": build_attention_mask(s, attention_mask, None, device),
                "sliding_attention": build_attention_mask(s, attention_mask, config.sliding_window, device)}
        local = self.local_rotary(position_ids, dtype) if self.local_rotary is not None else rotary
        return {"full_attention": rotary, "sliding_attention": local}, mask

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                return_logits: bool = True) -> GPTOutput:
        if labels is not None and targets is not None:
            raise ValueError("give labels (transformers' meaning: shifted by the model) or targets (aligned), not both")
        if labels is not None:
            targets = shift_labels(labels)
        ref = input_ids if input_ids is not None else targets
        if ref is None:
            raise ValueError("GPTModel.forward needs input_ids (first stage) or targets/labels (later stages)")
        b, s = ref.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=ref.device).unsqueeze(0).expand(b, s)
        if self.embedding is not None:
            hidden = self.embedding(input_ids, position_ids)  # [s, b, h]
        elif hidden_states is None:
            raise ValueError("a pipeline stage without the embedding needs hidden_states")
        else:
            hidden = hidden_states
        rotary, mask = self._rotary_and_mask(position_ids, hidden.dtype, attention_mask, s, ref.device)
        hidden = self.decoder(hidden, rotary, mask)
        if self.output_layer is None:
            return GPTOutput(hidden_states=hidden)

        tied = self.embedding.word_embeddings.weight if self.embedding is not None else None
        fused = getattr(self.vocab_loss, "fused_with_output", False) and self.config.final_logit_softcapping is None
        if targets is not None and not return_logits and fused:
            # output layer + loss in chunks (parallel/linear_loss.py): no [s, b, V] logits
            targets = targets.t()
            weight = self.output_layer.weight if self.output_layer.weight is not None else tied
            out = GPTOutput(loss_sum=self.vocab_loss.linear_loss_sum(hidden, weight, targets),
                            num_tokens=(targets != IGNORE_INDEX).sum())
            out.loss = out.loss_sum / out.num_tokens.clamp(min=1)
            return out
        logits = self.output_layer(hidden, tied)  # [s, b, V_padded(/tp)]; its own weight when it has one
        cap = self.config.final_logit_softcapping
        if cap is not None:  # elementwise, so also right on a vocab shard (padding stays 0)
            logits = torch.tanh(logits / cap) * cap
        out = GPTOutput()
        if targets is not None:
            targets = targets.t()
            per_token = self.vocab_loss(logits, targets, keep_logits=return_logits)
            out.num_tokens = (targets != IGNORE_INDEX).sum()
            out.loss_sum = per_token.sum()
            out.loss = out.loss_sum / out.num_tokens.clamp(min=1)
        if return_logits:
            out.logits = self.vocab_loss.full_logits(logits).transpose(0, 1)
        return out
