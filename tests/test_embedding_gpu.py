"""The embedding lookup's sync-free weight gradient (csrc/embedding.cu) vs PyTorch's nn.Embedding
(GPU only; skipped without CUDA).  Both sum each id's gradient rows in fp32 and round once, in
different orders: fp32 agrees norm-wise to 1e-6, bf16 / fp16 to 1 ulp per element."""
import pytest
import torch
from torch import nn

from hf_megatron import kernels
from hf_megatron.kernels import embedding

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.fixture(scope="module", autouse=True)
def extension():
    assert kernels.load_extension() is not None, "the CUDA extension failed to build (see the warning above)"


def _case(num, hidden, ids_shape, dtype, repeats=0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    module = nn.Embedding(num, hidden, device="cuda", dtype=dtype)
    ids = torch.randint(0, num, ids_shape, generator=gen, device="cuda")
    if repeats:  # one id filling a long stretch (padding / a frequent token)
        ids.view(-1)[:repeats] = 3
    probe = torch.randn(*ids_shape, hidden, generator=gen, device="cuda").to(dtype)
    return module, ids, probe


def _weight_grad(fn, module, ids, probe):
    module.weight.grad = None
    (fn(module, ids) * probe).float().sum().backward()
    return module.weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num,hidden,ids_shape,repeats", [
    (1000, 2048, (64, 4), 0),          # vectorised rows
    (128256, 2048, (2048, 8), 5000),   # Llama-3's table, a run of 5000 equal ids
    (50, 37, (9, 3), 10),              # hidden not a multiple of the pack: the scalar path
])
def test_weight_grad_matches_torch(monkeypatch, dtype, num, hidden, ids_shape, repeats):
    calls = []
    original = embedding.SyncFreeEmbedding.apply
    monkeypatch.setattr(embedding.SyncFreeEmbedding, "apply", lambda *a: calls.append(1) or original(*a))
    module, ids, probe = _case(num, hidden, ids_shape, dtype, repeats)
    out = embedding.lookup(module, ids)
    assert calls, "the kernel was not used"
    assert torch.equal(out, module(ids))
    ours = _weight_grad(embedding.lookup, module, ids, probe)
    ref = _weight_grad(lambda m, i: m(i), module, ids, probe)
    if dtype == torch.float32:
        assert ((ours - ref).norm() / ref.norm()).item() <= 1e-6
    else:
        torch.testing.assert_close(ours, ref, rtol=ULP[dtype], atol=ULP[dtype] * 1e-2)
    unused = torch.ones(num, dtype=torch.bool, device="cuda")
    unused[ids.reshape(-1)] = False
    assert torch.count_nonzero(ours[unused]) == 0


def test_weight_grad_is_deterministic_and_needs_no_host_sync():
    module, ids, probe = _case(128256, 2048, (2048, 8), torch.bfloat16, repeats=3000, seed=1)
    first = _weight_grad(embedding.lookup, module, ids, probe)
    out = embedding.lookup(module, ids)
    loss = (out * probe).float().sum()
    module.weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(module.weight.grad, first)
