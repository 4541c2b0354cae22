"""Megatron-compatible data pipeline.

* ``IndexedDataset`` / ``IndexedDatasetWriter`` / ``merge_datasets``: MMIDIDX .bin/.idx files
* ``build_gpt_datasets``: train/valid/test GPT datasets (megatron-core's indices, cached)
* ``batch_iterator`` / ``MegatronPretrainingSampler``: per-dp-rank micro batches, resumable
* ``build_tokenizer`` / ``train_bpe_tokenizer`` / ``train_sentencepiece_tokenizer``
* ``preprocess`` (``hf-megatron preprocess``): corpus -> .bin/.idx
"""
from .builder import build_gpt_datasets, parse_blend, split_bookends
from .gpt_dataset import BlendedDataset, GPTDataset
from .indexed import IndexedDataset, IndexedDatasetWriter, merge_datasets, optimal_dtype
from .loader import MegatronPretrainingSampler, batch_iterator
from .preprocess import PreprocessOptions, preprocess
from .tokenizers import build_tokenizer, train_bpe_tokenizer, train_sentencepiece_tokenizer

__all__ = ["IndexedDataset", "IndexedDatasetWriter", "merge_datasets", "optimal_dtype",
           "GPTDataset", "BlendedDataset", "build_gpt_datasets", "parse_blend", "split_bookends",
           "MegatronPretrainingSampler", "batch_iterator", "PreprocessOptions", "preprocess",
           "build_tokenizer", "train_bpe_tokenizer", "train_sentencepiece_tokenizer"]
