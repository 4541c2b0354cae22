"""The vocab loss's dispatcher on CPU: PyTorch's own cross entropy, bit for bit, whatever
`keep_logits` says (the in-place gradient is the CUDA kernel's; tests/test_cross_entropy_gpu.py)."""
import pytest
import torch
import torch.nn.functional as F

from hf_megatron.kernels import cross_entropy as ce
from hf_megatron.model.gpt import IGNORE_INDEX, VocabLoss


@pytest.mark.parametrize("keep_logits", [True, False])
def test_cpu_vocab_loss_is_torch_cross_entropy(keep_logits):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2, 40, generator=gen).to(torch.bfloat16)  # [s, b, V_padded], 37 classes
    targets = torch.randint(0, 37, (6, 2), generator=gen)
    targets[1, 0] = IGNORE_INDEX
    mine = logits.clone().requires_grad_()
    loss = VocabLoss(37)(mine * 1, targets, keep_logits=keep_logits)
    loss.sum().backward()
    ref = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref[..., :37].float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="none").view(6, 2)
    ref_loss.sum().backward()
    assert torch.equal(loss, ref_loss) and torch.equal(mine.grad, ref.grad)
    assert loss[1, 0] == 0 and torch.count_nonzero(mine.grad[..., 37:]) == 0


def test_kernel_is_only_for_cuda_tensors():
    assert not ce.kernel_fits(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long))
