"""GPTModel: embedding -> N transformer layers -> final norm -> output layer (-> loss).

Parameter names are megatron-core's (`embedding.word_embeddings.weight`,
`decoder.layers.N.self_attention.linear_qkv.weight`, ..., `decoder.final_layernorm`,
`output_layer.weight`).  Internally activations are [s, b, h] (Megatron's layout, which makes
sequence parallelism a split of dim 0); inputs and logits are [b, s] / [b, s, vocab] as in
transformers.

A pipeline stage is the same class with `pre_process` (owns the embedding),
`post_process` (owns final norm, output layer and loss) and a slice of the layers
(`layer_offset`, `num_layers`); its layer names are local to the stage, as Megatron writes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..parallel import comm, state
from ..parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from ..parallel.loss import vocab_parallel_cross_entropy
from ..parallel.random import replayable, tp_rng
from .attention import build_attention_mask
from .block import TransformerLayer
from .norms import RMSNorm, make_norm
from .rotary import RotaryEmbedding


@dataclass
class GPTOutput:
    loss: torch.Tensor | None = None  # mean over non-ignored tokens
    logits: torch.Tensor | None = None  # [b, s, vocab_size], gathered over TP, padding removed
    loss_sum: torch.Tensor | None = None  # sum of per-token losses (for micro-batch accumulation)
    num_tokens: torch.Tensor | None = None  # number of non-ignored target tokens
    hidden_states: torch.Tensor | None = None  # [s, b, h] output of a non-final pipeline stage


class Embedding(nn.Module):
    def __init__(self, config: ModelConfig, sequence_parallel: bool, dtype=None, device=None):
        super().__init__()
        # partial sums over TP ranks; reduced (or reduce-scattered along the sequence) below
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size(state.tp_size()), config.hidden_size,
                                                      reduce_output=False, dtype=dtype, device=device)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                    dtype=dtype, device=device)
        else:
            self.position_embeddings = None
        self.sequence_parallel = sequence_parallel
        self.dropout = config.embedding_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        words = self.word_embeddings(input_ids.t())  # [s, b, h]; partial over TP ranks
        positions = None
        if self.position_embeddings is not None:
            positions = self.position_embeddings(position_ids.t())
        if self.sequence_parallel:
            out = comm.sp_reduce_scatter(words)
            if positions is not None:
                out = out + comm.sp_scatter(positions)
        else:
            out = comm.reduce_from_tp(words)
            if positions is not None:
                out = out + positions
        if self.training and self.dropout > 0:
            if self.sequence_parallel:
                with tp_rng():
                    return F.dropout(out, self.dropout, True)
            return F.dropout(out, self.dropout, True)
        return out


class Decoder(nn.Module):
    def __init__(self, config, num_layers, post_process, sequence_parallel, recompute, dtype=None, device=None):
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(config, sequence_parallel, recompute == "selective", dtype=dtype, device=device)
            for _ in range(num_layers)
        )
        self.final_layernorm = make_norm(config, dtype=dtype, device=device) if post_process else None
        self.recompute_full = recompute == "full"

    def forward(self, hidden, rotary, mask):
        for layer in self.layers:
            if self.recompute_full and self.training and torch.is_grad_enabled():
                hidden = checkpoint(replayable(layer), hidden, rotary, mask, use_reentrant=False)
            else:
                hidden = layer(hidden, rotary, mask)
        return self.final_layernorm(hidden) if self.final_layernorm is not None else hidden


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig, *, pre_process: bool = True, post_process: bool = True,
                 layer_offset: int = 0, num_layers: int | None = None, sequence_parallel: bool = False,
                 recompute: str | None = None, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if recompute not in (None, "full", "selective"):
            raise ValueError(f"recompute must be None, 'full' or 'selective', got {recompute!r}")
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset = layer_offset
        self.num_layers = config.num_layers - layer_offset if num_layers is None else num_layers
        self.sequence_parallel = sequence_parallel and state.tp_size() > 1
        self.share_embeddings_and_output_weights = config.tie_word_embeddings
        sp = self.sequence_parallel

        self.embedding = Embedding(config, sp, dtype=dtype, device=device) if pre_process else None
        self.rotary = None
        if config.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(config.kv_channels, config.rotary_base, config.rope_scaling)
        self.decoder = Decoder(config, self.num_layers, post_process, sp, recompute, dtype=dtype, device=device)
        self.output_layer = None
        if post_process and not (pre_process and config.tie_word_embeddings):
            # untied, or tied but on a last stage that lacks the embedding (kept in sync by the
            # pipeline's embedding-group all-reduce, as Megatron does)
            self.output_layer = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size(state.tp_size()),
                                                     bias=False, sequence_parallel=sp, dtype=dtype, device=device)
        if sp:
            for module in self.modules():
                if isinstance(module, (nn.LayerNorm, RMSNorm)):
                    for p in module.parameters():
                        p.sequence_parallel = True  # grads from a sequence shard: all-reduce over TP

    # ------------------------------------------------------------------ weights
    def output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def load_full_state_dict(self, full: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load unsharded megatron-core weights (global layer numbers, unpadded vocab)."""
        from ..conversion.layout import shard_for_model
        missing = self.load_state_dict(shard_for_model(full, self), strict=False)
        if strict and (missing.missing_keys or missing.unexpected_keys):
            raise KeyError(f"weights do not match the model: missing {missing.missing_keys[:5]}, "
                           f"unexpected {missing.unexpected_keys[:5]}")

    def init_weights(self, seed: int = 1234) -> None:
        """Megatron-style init (normal(0, std); output projections scaled by 1/sqrt(2L)),
        generated at full size from `seed` and then sharded, so any TP/PP layout starts from the
        same weights as one process."""
        from ..conversion.layout import random_full_state_dict
        self.load_full_state_dict(random_full_state_dict(self.config, seed), strict=False)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None, return_logits: bool = True) -> GPTOutput:
        ref = input_ids if input_ids is not None else labels
        if ref is None:
            raise ValueError("GPTModel.forward needs input_ids (first stage) or labels (last stage)")
        b, s = ref.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=ref.device).unsqueeze(0).expand(b, s)
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
        else:
            if hidden_states is None:
                raise ValueError("a non-first pipeline stage needs hidden_states")
            hidden = hidden_states
        rotary = None
        if self.rotary is not None:
            rotary = self.rotary(position_ids, hidden.dtype)
        mask = build_attention_mask(s, attention_mask, self.config.sliding_window, ref.device)
        hidden = self.decoder(hidden, rotary, mask)
        if not self.post_process:
            return GPTOutput(hidden_states=hidden)

        x = comm.sp_gather(hidden) if self.sequence_parallel else comm.copy_to_tp(hidden)
        logits = F.linear(x, self.output_weight())  # [s, b, padded_vocab / tp]
        out = GPTOutput()
        if labels is not None:
            shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), -100)], dim=1).t()  # HF shift
            per_token = vocab_parallel_cross_entropy(logits, shifted, self.config.vocab_size)
            out.num_tokens = (shifted != -100).sum()
            out.loss_sum = per_token.sum()
            out.loss = out.loss_sum / out.num_tokens.clamp(min=1)
        if return_logits:
            full = comm.gather_from_tp(logits, -1)[..., : self.config.vocab_size]
            out.logits = full.transpose(0, 1)
        return out
