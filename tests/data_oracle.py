"""megatron-core 0.16.1 as the test oracle for the data pipeline (imported only by tests)."""
from __future__ import annotations

import warnings

import numpy as np

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers as mcore_helpers  # noqa: F401  (compiled C++ index helpers)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


class OracleTokenizer:
    """The few attributes GPTDatasetConfig reads from a tokenizer."""

    def __init__(self, vocab_size: int = 1002):  # corpora use ids < 1000: pad/eod never occur
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = vocab_size - 2
        self.unique_identifiers = {"class": "OracleTokenizer", "vocab_size": vocab_size}


def write_random_corpus(prefix: str, num_docs: int, seed: int, dtype=np.uint16, max_len: int = 60,
                        sequences_per_doc: int = 1, vocab: int = 1000) -> list[list[np.ndarray]]:
    """Write a corpus with megatron-core's builder; returns the documents (lists of sequences)."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    docs = []
    for _ in range(num_docs):
        sequences = [rng.integers(0, vocab, size=int(rng.integers(1, max_len))).astype(dtype)
                     for _ in range(int(rng.integers(1, sequences_per_doc + 1)))]
        import torch

        for seq in sequences:
            builder.add_item(torch.from_numpy(seq.astype(np.int64)))
        builder.end_document()
        docs.append(sequences)
    builder.finalize(prefix + ".idx")
    return docs


def mcore_datasets(blend: tuple, split: str, seq_length: int, seed: int, sizes: list,
                   add_extra_token: bool = True, drop_last_partial_validation: bool = True):
    """megatron-core's (train, valid, test) for blend=(prefixes, weights or None)."""
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, split=split,
        tokenizer=OracleTokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, add_extra_token_to_sequence=add_extra_token,
        drop_last_partial_validation_sequence=drop_last_partial_validation)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
