"""SFT records -> token ids and a loss mask of the same length (1 = a response token, scored).

Two record shapes (``hf-megatron preprocess --sft``):

* ``--json-keys PROMPT RESPONSE``: ``ids = tok(prompt) + tok(response)`` where the prompt gets
  the special tokens the tokenizer adds (a BOS, say) and the response none; the mask is 0 on the
  prompt and 1 on the response.  Each part is tokenised on its own, as Megatron-LM / NeMo SFT do,
  so the boundary never merges prompt and response characters into one token.
* ``--json-keys MESSAGES``: a chat list ``[{"role": ..., "content": ...}, ...]`` rendered once with
  the tokenizer's chat template and tokenised once (offsets kept).  Assistant turn ``k`` covers
  the characters ``[len(render(m[:k], add_generation_prompt)), len(render(m[:k+1])))`` of the
  full rendering (the header the generation prompt adds is context, not scored; without a
  generation prompt the turn starts at ``len(render(m[:k]))``); a token is scored when it overlaps
  an assistant span, as transformers' ``return_assistant_tokens_mask`` marks every token from the
  one holding the span's first character to the one holding its last (a header ending in a space
  that the first response word absorbs, ``'Assistant: '`` + ``'tool'`` -> ``' tool'``, is scored).  Templates that rewrite earlier turns when a later one is
  added cannot be cut this way and are refused naming the record.

``--append-eod`` appends the end-of-document id, scored (the model learns to stop).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import DataError


def loss_mask_prefix(tokens_prefix: str) -> str:
    """Where the loss mask of an SFT token dataset lives: ``{prefix}_loss_mask.bin/.idx``."""
    return tokens_prefix + "_loss_mask"


def encode_prompt_response(tokenizer, records: list[dict], keys: list[str], append_eod: bool
                           ) -> list[tuple[list[int], np.ndarray]]:
    prompt_key, response_key = keys
    prompts = tokenizer.tokenize_batch([str(r[prompt_key]) for r in records])
    responses = tokenizer.tokenize_batch([str(r[response_key]) for r in records], add_special_tokens=False)
    out = []
    for prompt, response in zip(prompts, responses):
        response = list(response) + ([tokenizer.eod] if append_eod else [])
        mask = np.zeros(len(prompt) + len(response), np.uint8)
        mask[len(prompt):] = 1
        out.append((list(prompt) + response, mask))
    return out


# the chat roles of OpenAI's messages and of transformers' chat templates: "assistant" turns are scored,
# the others are context; any other name ("gpt", "bot", "model", "Assistant") would be context without a word
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"expected a non-empty list of chat messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"message {i} must be an object with 'role' and 'content'")
        if message["role"] not in CHAT_ROLES:
            raise DataError(f"message {i} has role {message['role']!r}, expected one of "
                            f"{', '.join(CHAT_ROLES)} (assistant turns are scored)")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("no assistant message (nothing to score)")


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans of its assistant turns (module docstring); a
    DataError says what is wrong, the caller says which record."""
    full = tokenizer.render_chat(messages)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = tokenizer.render_chat(messages[:k + 1])
        starts = []
        if k:
            starts = [tokenizer.render_chat(messages[:k], add_generation_prompt=True),
                      tokenizer.render_chat(messages[:k])]
        start = next((len(s) for s in starts if upto.startswith(s)), 0 if not k else None)
        if start is None:
            raise DataError(f"the chat template does not render turns incrementally (adding message {k} "
                            "changes the text of the messages before it), so assistant tokens cannot be located")
        if not full.startswith(upto):
            raise DataError(f"the chat template does not render turns incrementally (the text of messages "
                            f"0..{k} changes when later messages are added), so assistant tokens cannot be located")
        spans.append((start, len(upto)))
    return full, spans


def check_sft_keys(tokenizer, keys: list[str]) -> None:
    """Fail before any work on keys / a tokenizer that cannot make SFT records."""
    if len(keys) not in (1, 2):
        raise DataError(f"--sft: --json-keys takes PROMPT RESPONSE or one chat MESSAGES field, got {keys}")
    hf = getattr(tokenizer, "tokenizer", None)
    if len(keys) == 1 and not (getattr(hf, "chat_template", None) and getattr(hf, "is_fast", False)):
        raise DataError(f"--sft --json-keys {keys[0]}: chat messages need a fast transformers tokenizer with a "
                        "chat template (--tokenizer-type HuggingFaceTokenizer; this one has none)")


def _render_chat(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    _check_messages(messages)
    try:
        return assistant_spans(tokenizer, messages)
    except DataError:
        raise
    except Exception as exc:  # the template itself raised (jinja errors, raise_exception(...))
        raise DataError(f"chat template failed ({exc})".splitlines()[0]) from None


def encode_chat(tokenizer, records: list[dict], key: str, append_eod: bool, place: Callable[[int], str]
                ) -> list[tuple[list[int], np.ndarray]]:
    rendered = []
    for i, record in enumerate(records):
        try:
            rendered.append(_render_chat(tokenizer, record[key]))
        except DataError as exc:
            raise DataError(f"{place(i)}: {exc}") from None
    ids_list, offsets_list = tokenizer.tokenize_with_offsets([text for text, _ in rendered])
    out = []
    for ids, offsets, (_, spans) in zip(ids_list, offsets_list, rendered):
        bounds = np.array(offsets, np.int64).reshape(-1, 2)
        starts, ends = bounds[:, 0], bounds[:, 1]
        mask = np.zeros(len(ids), bool)
        for begin, end in spans:  # overlapping the span, or (a zero-width token) starting inside it
            mask |= ((starts < end) & (ends > begin)) | ((starts >= begin) & (starts < end))
        ids = list(ids) + ([tokenizer.eod] if append_eod else [])
        out.append((ids, np.concatenate([mask, [True] * append_eod]).astype(np.uint8)))
    return out


def encode_sft_batch(tokenizer, records: list[dict], keys: list[str], append_eod: bool,
                     place: Callable[[int], str]) -> list[tuple[list[int], np.ndarray]]:
    """(ids, loss mask) per record, for two keys (prompt, response) or one (chat messages);
    ``place(i)`` names ``records[i]`` in an error (called only then)."""
    if len(keys) == 2:
        return encode_prompt_response(tokenizer, records, keys, append_eod)
    return encode_chat(tokenizer, records, keys[0], append_eod, place)
