"""Text samples during training: the continuation of a fixed prompt, greedy or at a temperature,
computed with this rank's model chunks in any tp / sp / pp / vpp layout.

Collective over the model-parallel group: every tp and pp rank calls `generate_ids` (each data-
parallel replica samples on its own; the logging rank prints its result).

* pp = 1: every TP rank runs the whole forward; the vocab-parallel logits are gathered over TP
  (`vocab_loss.full_logits`), so all TP ranks see the same logits and pick the same token.
* pp > 1: the forward runs chunk by chunk in model-chunk order c = 0 .. pp * vpp - 1 (chunk c
  lives on pipeline rank c % pp, Megatron's interleaved assignment); the [s, b, h] activation
  ([s / tp, b, h] with sequence parallelism) goes from the owner of c to the owner of c + 1 by
  point-to-point send / recv.  The last stage picks the token and broadcasts it over the pp group.

No KV cache (these are small, occasional samples): each new token reruns the forward over one
fixed window of W = prompt + new tokens positions (at most max_position_embeddings, a multiple
of tp under sequence parallelism), padded on the right.  Causal attention means the padding after
position t never changes the logits at t, so the result equals step-by-step generation.

Temperature T > 0 draws from softmax(logits / T) with a CPU torch.Generator seeded from
(seed, iteration): the same draw on every rank, and the training RNG streams are never touched.
The chunks are left in eval mode (train_step switches them back).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..errors import DataError
from ..model.gpt import IGNORE_INDEX
from ..parallel import state


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def window_length(prompt_len: int, new_tokens: int, max_positions: int, multiple: int) -> int:
    """W: room for the prompt and the new tokens, capped at the model's positions, rounded to `multiple`."""
    wanted = min(prompt_len + new_tokens, max_positions)
    rounded = -(-wanted // multiple) * multiple
    return rounded if rounded <= max_positions else (max_positions // multiple) * multiple


def _forward_logits(chunks, ids: torch.Tensor, position: int) -> torch.Tensor | None:
    """Full-vocabulary logits at `position` of ids [1, W]; on the last pipeline stage only (else None)."""
    grid = state.get_state()
    pp, pp_rank = grid.pp, grid.coords["pp"]
    ignored = torch.full_like(ids, IGNORE_INDEX)  # gives stages without the embedding their [b, s] shape
    hidden, out = None, None
    for c in range(pp * len(chunks)):
        if c % pp != pp_rank:
            continue
        chunk = chunks[c // pp]
        gpt = _unwrap(chunk)
        if c > 0:  # from the owner of chunk c - 1
            tp = grid.tp if getattr(gpt, "sequence_parallel", False) else 1
            hidden = torch.empty(ids.shape[1] // tp, ids.shape[0], gpt.config.hidden_size,
                                 dtype=gpt.activation_dtype, device=ids.device)
            dist.recv(hidden, src=grid.ranks["pp"][(c - 1) % pp], group=grid.group("pp"))
        out = chunk(input_ids=ids, hidden_states=hidden, targets=ignored, return_logits=gpt.post_process)
        if not gpt.post_process:
            dist.send(out.hidden_states.to(gpt.activation_dtype).contiguous(),
                      dst=grid.ranks["pp"][(c + 1) % pp], group=grid.group("pp"))
    if pp_rank != pp - 1:
        return None
    return out.logits[0, position]


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    logits = logits.detach().float().cpu()
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate_ids(chunks, prompt_ids: list[int], new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> list[int]:
    """The `new_tokens` ids that follow `prompt_ids` (fewer if the window fills up)."""
    grid = state.get_state()
    gpt = _unwrap(chunks[0])
    multiple = grid.tp if getattr(gpt, "sequence_parallel", False) else 1
    width = window_length(len(prompt_ids), new_tokens, gpt.config.max_position_embeddings, multiple)
    prompt_ids = list(prompt_ids)[-(width - 1):] if width > 1 else []  # keep the prompt's end
    if not prompt_ids:
        return []
    device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
    ids = torch.zeros(1, width, dtype=torch.long, device=device)
    ids[0, :len(prompt_ids)] = torch.tensor(prompt_ids)
    generator = torch.Generator().manual_seed(seed)
    for chunk in chunks:
        chunk.eval()
    length, produced = len(prompt_ids), []
    while len(produced) < new_tokens and length < width:
        logits = _forward_logits(chunks, ids, length - 1)
        token = torch.zeros(1, dtype=torch.long, device=device)
        if logits is not None:
            token[0] = _pick(logits, temperature, generator)
        if grid.pp > 1:
            dist.broadcast(token, src=grid.ranks["pp"][-1], group=grid.group("pp"))
        ids[0, length] = token[0]
        produced.append(int(token[0]))
        length += 1
    return produced


class TextSampler:
    """A tokenizer, the prompt and the sampling settings of one run."""

    def __init__(self, tokenizer, prompt: str, new_tokens: int, temperature: float = 0.0, seed: int = 0):
        self.tokenizer, self.prompt = tokenizer, prompt
        self.new_tokens, self.temperature, self.seed = new_tokens, temperature, seed
        self.prompt_ids = list(tokenizer.encode(prompt))
        if not self.prompt_ids:
            raise DataError(f"--sample-prompt {prompt!r}: the tokenizer gives no tokens for it")

    def __call__(self, chunks, iteration: int) -> str:
        vocab = _unwrap(chunks[0]).config.vocab_size
        if max(self.prompt_ids) >= vocab:
            return f"[no sample: the prompt has token id {max(self.prompt_ids)}, the model's vocabulary is {vocab}]"
        ids = generate_ids(chunks, self.prompt_ids, self.new_tokens, self.temperature,
                           seed=self.seed * 1_000_003 + iteration)
        return self.tokenizer.decode(ids)


def load_tokenizer(path: str):
    """A transformers tokenizer (folder or Hub id) or a SentencePiece `.model` file: encode/decode."""
    if path.endswith(".model") and os.path.isfile(path):
        import sentencepiece
        try:
            return sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as exc:
            raise DataError(f"{path}: not a SentencePiece model ({str(exc).strip()})".splitlines()[0]) from None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        raise DataError(f"{path}: cannot load a tokenizer ({str(exc).strip()})".splitlines()[0]) from None


def sampler_for_run(run, seed: int) -> tuple[TextSampler | None, str | None]:
    """(sampler, None), or (None, why there are no samples) for a run with --sample-prompt.

    The tokenizer is --tokenizer-model (an error if it does not load), else the --hf-model or
    --hf-config folder's own, if it has one."""
    if not run.sample_prompt:
        return None, None
    if getattr(run, "vocab_file", None):  # --tokenizer-type GPT2BPETokenizer
        from .tokenizer_files import gpt2_bpe_folder
        tokenizer = load_tokenizer(str(gpt2_bpe_folder(run.vocab_file, run.merge_file)))
    elif run.tokenizer_model:
        tokenizer = load_tokenizer(run.tokenizer_model)
    else:
        folder = run.hf_model or run.hf_config
        folder = folder if folder and os.path.isdir(folder) else os.path.dirname(folder or "")
        tokenizer = None
        if folder and (os.path.isfile(os.path.join(folder, "tokenizer.json"))
                       or os.path.isfile(os.path.join(folder, "tokenizer_config.json"))):
            tokenizer = load_tokenizer(folder)
        elif run.hf_model and not os.path.exists(run.hf_model):  # a Hub id
            try:
                tokenizer = load_tokenizer(run.hf_model)
            except DataError:
                tokenizer = None
        if tokenizer is None:
            return None, ("text samples skipped: no tokenizer (give --tokenizer-model; the --hf-model / "
                          "--hf-config folder has none)")
    return TextSampler(tokenizer, run.sample_prompt, run.sample_tokens, run.sample_temperature, seed), None
