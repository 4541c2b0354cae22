"""The word embedding tied across pipeline stages, as checkpoints name it.

With tied embeddings and pp > 1 the last stage keeps its own copy of the word-embedding table as
`output_layer.weight` (a stage that also holds the embedding has no such weight: the output layer
reads the embedding's).  A checkpoint that stores each tensor once -- megatron-core's torch_dist
global tensors, the full tensors a reshard merges -- stores that copy as the embedding; a stage's
copy is read from there (torch_dist_resume.py, reshard_optimizer.py).
"""
from __future__ import annotations

EMBEDDING = "embedding.word_embeddings.weight"
TIED_COPY = "output_layer.weight"  # the last stage's copy of EMBEDDING when the embeddings are tied


def source_name(chunks, name: str) -> str:
    """The stored tensor param `name` of one pipeline stage's model chunks is: EMBEDDING for the
    stage's tied copy (tie_word_embeddings, and no chunk of the stage holds the embedding), else
    `name` itself."""
    tied_copy = name == TIED_COPY and chunks[0].config.tie_word_embeddings and not any(c.pre_process for c in chunks)
    return EMBEDDING if tied_copy else name
