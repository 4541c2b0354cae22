"""The embedding lookup on CPU, and for modules it does not handle: the module itself."""
import torch
from torch import nn

from hf_megatron.kernels import embedding


def test_cpu_and_unusual_modules_use_the_module():
    ids = torch.tensor([[1, 2, 2], [0, 3, 1]])
    for module in (nn.Embedding(5, 4), nn.Embedding(5, 4, padding_idx=0), nn.Embedding(5, 4, max_norm=1.0)):
        out = embedding.lookup(module, ids)
        ref = module(ids)
        assert torch.equal(out, ref)
        out.sum().backward()
        assert module.weight.grad is not None
