"""float8 linears (parallel/float8.py): a clear error where they cannot run; on a float8 GPU, the
loss and gradients track the bf16 model.

Tolerance (GPU): e4m3 keeps 3 mantissa bits (relative rounding 2^-4 per element) with one scale per
tensor, so a matmul's output moves by a few percent elementwise; summed into a cross entropy
the loss of a random tiny model stays within 2% of bf16, and each weight gradient points the same
way (cosine similarity >= 0.95) -- a wrong scale or a transposed cast would break both.
"""
import pytest
import torch

from hf_megatron.errors import ConfigError
from tiny import VOCAB, tiny_hf_model

FLOAT8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _model(dtype, device):
    from hf_megatron.loading import build_model
    # hidden 64 / ffn 128 are multiples of 16: every layer linear is eligible
    return build_model(tiny_hf_model("llama"), dtype=dtype, device=device)


@pytest.mark.skipif(FLOAT8_GPU, reason="checks the refusal without a float8 GPU")
def test_float8_without_a_float8_gpu_is_one_clear_error():
    from hf_megatron.parallel.float8 import apply_float8
    with pytest.raises(ConfigError, match="float8: needs a CUDA GPU"):
        apply_float8(_model(torch.float32, "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not FLOAT8_GPU, reason="needs a GPU with float8 tensor cores (sm89+)")
@pytest.mark.parametrize("compiled", [False, True])
def test_float8_tracks_bf16(compiled):
    pytest.importorskip("torchao")
    from hf_megatron.parallel.compile import apply_compile
    from hf_megatron.parallel.float8 import apply_float8
    ids = torch.randint(0, VOCAB, (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for float8 in (False, True):
        model = _model(torch.bfloat16, "cuda")
        if float8:
            apply_float8(model)
            converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
            assert len(converted) == 2 * 4, converted  # qkv, proj, fc1, fc2 in each of 2 layers
        if compiled:
            apply_compile(model)
        out = model(input_ids=ids, labels=ids, return_logits=False)
        out.loss.backward()
        grads = {n: p.grad.float().flatten() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.item(), grads))
    (loss_bf16, grads_bf16), (loss_f8, grads_f8) = results
    assert abs(loss_f8 - loss_bf16) <= 0.02 * loss_bf16, (loss_f8, loss_bf16)
    assert grads_f8.keys() == grads_bf16.keys()
    for name in grads_bf16:
        cos = torch.nn.functional.cosine_similarity(grads_f8[name], grads_bf16[name], dim=0).item()
        assert cos >= 0.95, (name, cos)
