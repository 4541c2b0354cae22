"""Tokenizers for preprocessing, named as Megatron-LM's ``--tokenizer-type`` values.

Each exposes ``tokenize(text) -> list[int]``, ``tokenize_batch(texts, add_special_tokens=True)``,
``eod`` (end-of-document id appended by ``--append-eod``) and ``vocab_size`` (which picks the .bin
token dtype); ``HFTokenizer`` also renders chat templates for SFT (sft_records.py).

* ``HuggingFaceTokenizer``  --tokenizer-model DIR_OR_HUB_ID (AutoTokenizer; special tokens as the
  tokenizer adds them, like Megatron-LM)
* ``GPT2BPETokenizer``      --vocab-file vocab.json --merge-file merges.txt
* ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer``  --tokenizer-model x.model
* ``Llama2Tokenizer``       --tokenizer-model x.model (SentencePiece with BOS prepended)
* ``NullTokenizer``         text is already whitespace-separated ids; --vocab-size N: ids 0..N-1, eod = N,
  vocab_size = N + 1 (megatron-core's NullTokenizer)

``train_bpe_tokenizer`` / ``train_sentencepiece_tokenizer`` make a new one from a corpus.
"""
from __future__ import annotations

import os
from typing import Iterable

from ..config import has_endoftext
from ..errors import ConfigError, DataError, DataNotFoundError

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "Llama2Tokenizer", "NullTokenizer")


def _require_file(path: str | None, flag: str, what: str) -> str:
    if not path:
        raise ConfigError(f"{flag} is required ({what})")
    if not os.path.exists(path):
        raise DataNotFoundError(f"{path}: {what} not found ({flag})")
    return path


PROBE = "Hello, World!  12 345 café\n\tdone. <|endoftext|>"  # checks the backend gives tokenizer()'s ids


class HFTokenizer:
    """A transformers tokenizer.  Batches go straight to its Rust backend when it has one
    (``encode_batch_fast``: the ids ``tokenizer(texts)`` gives, without building offsets or a
    BatchEncoding), which is what makes preprocessing fast."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        eod = tokenizer.eos_token_id
        if eod is None:
            eod = tokenizer.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tokenizer.get_vocab() else None
        self.eod = eod
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self._encode_batch = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
        if self._encode_batch is not None and self._backend_ids(PROBE) != tokenizer(PROBE).input_ids:
            self._encode_batch = None  # the Python side adds something (normalisation, special tokens)

    def _backend_ids(self, text: str) -> list[int]:
        return self._encode_batch([text], add_special_tokens=True)[0].ids

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def tokenize_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if not texts:
            return []
        if self._encode_batch is not None:
            return [e.ids for e in self._encode_batch(texts, add_special_tokens=add_special_tokens)]
        return self.tokenizer(texts, add_special_tokens=add_special_tokens).input_ids

    def tokenize_with_offsets(self, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        """Ids of already-rendered texts (no special tokens added) and each token's character span."""
        out = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return out.input_ids, out.offset_mapping

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


class SentencePieceTokenizer:
    def __init__(self, model_file: str, add_bos: bool = False):
        import sentencepiece

        try:
            self.processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as exc:  # sentencepiece reports a bad file as RuntimeError
            raise DataError(f"{model_file}: not a SentencePiece model ({str(exc).strip()})".splitlines()[0]) from None
        self.vocab_size = self.processor.get_piece_size()
        self.eod = self.processor.eos_id()
        self.add_bos = add_bos

    def tokenize(self, text: str) -> list[int]:
        return self.processor.encode(text, add_bos=self.add_bos)

    def tokenize_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return self.processor.encode(texts, add_bos=self.add_bos and add_special_tokens) if texts else []


class NullTokenizer:
    """megatron-core's NullTokenizer (megatron/core/tokenizers/text/libraries/null_tokenizer.py): for
    ``--vocab-size N`` the ids are 0..N-1, the end-of-document id is N, and ``vocab_size`` -- what
    the .bin dtype and the model's vocabulary (padded as Megatron-LM pads) are chosen for -- is N + 1."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        """Space-separated token ids, each in [0, vocab_size) (eod included)."""
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise DataError(f"NullTokenizer: expected space-separated token ids, got {text[:40]!r}") from None
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise DataError(f"NullTokenizer: a token id of {text[:40]!r} is outside [0, {self.eod}] (--vocab-size "
                            f"{self.eod}: ids 0..{self.eod - 1} and the eod {self.eod})")
        return ids

    def tokenize_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, vocab_size: int | None = None):
    """The tokenizer named by Megatron-LM's flags (see the module docstring)."""
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ConfigError("--tokenizer-model is required for HuggingFaceTokenizer (a tokenizer directory or Hub id)")
        from transformers import AutoTokenizer

        try:
            return HFTokenizer(AutoTokenizer.from_pretrained(tokenizer_model))
        except (OSError, ValueError) as exc:
            raise DataNotFoundError(f"{tokenizer_model}: cannot load a transformers tokenizer ({exc})".splitlines()[0]) from None
        except Exception as exc:  # the tokenizers library's parse errors of a damaged tokenizer.json
            raise DataError(f"{tokenizer_model}: cannot load a transformers tokenizer "
                            f"({type(exc).__name__}: {exc})".splitlines()[0]) from None
    if tokenizer_type == "GPT2BPETokenizer":
        from transformers import GPT2TokenizerFast

        vocab = _require_file(vocab_file, "--vocab-file", "GPT-2 vocab.json")
        merges = _require_file(merge_file, "--merge-file", "GPT-2 merges.txt")
        # positional: transformers 4 names them vocab_file/merges_file, transformers 5 vocab/merges
        try:
            tokenizer = GPT2TokenizerFast(vocab, merges)
        except Exception as exc:  # a damaged vocab.json / merges.txt
            raise DataError(f"{vocab} / {merges}: cannot build the GPT-2 BPE tokenizer "
                            f"({type(exc).__name__}: {exc})".splitlines()[0]) from None
        if not has_endoftext(vocab):  # transformers would add it past the vocab; Megatron-LM fails
            raise DataError(f"{vocab}: expected a GPT-2 vocab.json holding '<|endoftext|>' (GPT2BPETokenizer's "
                            "end-of-document token); use --tokenizer-type HuggingFaceTokenizer for another vocab")
        return HFTokenizer(tokenizer)
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        model = _require_file(tokenizer_model, "--tokenizer-model", "SentencePiece model file")
        return SentencePieceTokenizer(model, add_bos=tokenizer_type == "Llama2Tokenizer")
    if tokenizer_type == "NullTokenizer":
        if not vocab_size:
            raise ConfigError("--vocab-size is required for NullTokenizer")
        if vocab_size < 1:
            raise ConfigError(f"--vocab-size: expected a positive number, got {vocab_size}")
        return NullTokenizer(vocab_size)
    raise ConfigError(f"unknown --tokenizer-type {tokenizer_type!r}; expected one of {', '.join(TOKENIZER_TYPES)}")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, output_dir: str,
                        eos_token: str = "<|endoftext|>"):
    """Train a byte-level BPE (``tokenizers``) on ``texts`` and save it as a transformers tokenizer
    directory (loadable with ``AutoTokenizer`` / ``--tokenizer-type HuggingFaceTokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token, bos_token=eos_token,
                                   unk_token=eos_token)
    fast.save_pretrained(output_dir)
    return fast


def train_sentencepiece_tokenizer(texts: Iterable[str], vocab_size: int, model_prefix: str,
                                  model_type: str = "bpe") -> str:
    """Train a SentencePiece model on ``texts``; returns the path of ``{model_prefix}.model``."""
    import sentencepiece

    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=model_prefix, vocab_size=vocab_size,
            model_type=model_type, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
            hard_vocab_limit=False, minloglevel=2)
    except RuntimeError as exc:  # e.g. a vocabulary smaller than the corpus's characters
        reason = str(exc).strip().splitlines()[0].rsplit("] ", 1)[-1]
        raise DataError(f"--vocab-size {vocab_size}: SentencePiece cannot train it ({reason})") from None
    return model_prefix + ".model"
