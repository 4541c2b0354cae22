"""Forward-only pass that returns the logits (`MegatronLMPlugin(return_logits=True)` in eval mode).

The whole dp-local batch goes through the model chunks in pipeline order as one batch (no
micro batches, no schedule: nothing is kept for a backward).  Model chunk c = v * pp + r sits
on pipeline rank r as its v-th chunk; the activation [s(/tp with sequence parallelism), b, h]
goes from chunk c to chunk c + 1 by a point-to-point send to the next pipeline rank, each
tensor-parallel rank to its peer.  The last chunk computes the full-vocabulary logits
[b, s, vocab] (gathered over TP, padding removed) and the loss sums; they are then broadcast to
the other pipeline ranks, so every rank of the model replica returns the same outputs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...parallel import state


def _activation_shape(chunk, batch_size: int, seq: int) -> tuple[int, int, int]:
    tp = state.get_state().tp
    s = seq // tp if getattr(chunk, "sequence_parallel", False) else seq
    return (s, batch_size, chunk.config.hidden_size)


@torch.no_grad()
def forward_with_logits(chunks, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_sum, num_tokens, logits) of one batch {input_ids, targets, optional masks}."""
    grid = state.get_state()
    pp, pp_rank = grid.pp, grid.coords["pp"]
    ranks = grid.ranks.get("pp", [grid.rank])
    stages = pp * len(chunks)
    extra = {k: micro[k] for k in ("attention_mask", "position_ids") if k in micro}
    b, s = micro["input_ids"].shape
    hidden, out = None, None
    for stage in range(pp_rank, stages, pp):  # this rank's chunks, in pipeline order
        chunk = chunks[stage // pp]
        if stage > 0:
            param = next(chunk.parameters())
            hidden = torch.empty(_activation_shape(chunk, b, s), dtype=param.dtype, device=param.device)
            dist.recv(hidden, src=ranks[(stage - 1) % pp], group=grid.group("pp"))
        inputs = {"input_ids": micro["input_ids"]} if chunk.pre_process else {"hidden_states": hidden}
        out = chunk(targets=micro["targets"], return_logits=chunk.post_process, **inputs, **extra)
        if not chunk.post_process:
            dist.send(out.hidden_states.contiguous(), dst=ranks[(stage + 1) % pp], group=grid.group("pp"))
    last = ranks[(stages - 1) % pp]
    if pp == 1:
        return out.loss_sum.double(), out.num_tokens.double(), out.logits
    config = chunks[0].config
    device = micro["input_ids"].device
    if grid.rank == last:
        totals = torch.stack([out.loss_sum.double(), out.num_tokens.double()])
        logits = out.logits.contiguous()
    else:
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        dtype = next(chunks[0].parameters()).dtype
        logits = torch.empty(b, s, config.vocab_size, dtype=dtype, device=device)
    dist.broadcast(totals, src=last, group=grid.group("pp"))
    dist.broadcast(logits, src=last, group=grid.group("pp"))
    return totals[0], totals[1], logits
