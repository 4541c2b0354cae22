"""The Megatron-LM checkpoint format in one place.

    names.py       the layer-name rule: global <-> stage-local names, model-chunk keys
    args.py        the `args` namespace Megatron stores: one table of Megatron-LM's fields (ModelConfig both ways)
    rng.py         the rank file's RNG entry in Megatron-LM's layout (capture / restore)
    files.py       tracker, iter_/mp_rank_ names, staging + atomic replace, safe side-file copies
    writer.py      the one rank-file builder; full tensors -> rank files at any TP/PP/VPP
    unpickle.py    loading pickles through exact allow-lists only
    reader.py      what every reader offers (full tensors by global name)
    mcore.py       torch-format rank files (ours, megatron-core's, Megatron-LM's)
    legacy.py      Megatron-LM legacy and TransformerEngine names, old QKV orders (both ways)
    torch_dist.py  megatron-core's torch.distributed.checkpoint folders (read and write)
    load.py        open any of them; load one into a model of any layout

Imports only errors, config, architectures and parallel (sharding, state, random) from the library.
"""
