"""Both compile scopes, and a memory budget, with inductor on a GPU against eager (GPU only; skipped
without CUDA).

tests/test_compile.py checks the scopes with the aot_eager backend on CPU; here inductor generates
the CUDA code of one region per layer or of the whole decoder, in bf16: loss within 1e-2 relative,
every gradient within 1e-2 norm-wise (a few bf16 ulps: inductor fuses and reorders the elementwise
work, eager rounds after every op)."""
import sys
from pathlib import Path

import pytest
import torch

from hf_megatron.loading import build_model
from tiny import rel_err, tiny_hf_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from recompute_memory import saved_bytes  # noqa: E402  (bytes autograd keeps for backward)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16_TOL = 1e-2


def _loss_and_grads(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(ids, targets=ids)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("scope", ["layer", "decoder"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_inductor_scopes_track_eager_in_bf16(arch, scope):
    torch._dynamo.reset()
    hf = tiny_hf_model(arch)
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    eager = build_model(hf, dtype=torch.bfloat16, device="cuda")
    compiled = build_model(hf, dtype=torch.bfloat16, device="cuda", compile={"scope": scope})
    loss, grads = _loss_and_grads(compiled, ids)
    ref_loss, ref_grads = _loss_and_grads(eager, ids)
    assert abs(loss - ref_loss) <= BF16_TOL * abs(ref_loss)
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) <= BF16_TOL, name


@pytest.mark.parametrize("budget", [0.8, 0.5])
def test_memory_budget_under_inductor_saves_less_and_tracks_eager(budget):
    """--activation-memory-budget with inductor's CUDA code and the csrc SwiGLU custom op in the graph."""
    hf = tiny_hf_model("llama")
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    torch._dynamo.reset()
    default = build_model(hf, dtype=torch.bfloat16, device="cuda", compile=True)
    _loss_and_grads(default, ids)
    saved_default = saved_bytes(default, ids)
    torch._dynamo.reset()  # the budget applies to graphs compiled under it
    compiled = build_model(hf, dtype=torch.bfloat16, device="cuda", compile={"memory_budget": budget})
    loss, grads = _loss_and_grads(compiled, ids)
    ref_loss, ref_grads = _loss_and_grads(build_model(hf, dtype=torch.bfloat16, device="cuda"), ids)
    assert abs(loss - ref_loss) <= BF16_TOL * abs(ref_loss)
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) <= BF16_TOL, name
    saved = saved_bytes(compiled, ids)
    print(f"budget {budget}: {saved} of the default partition's {saved_default} bytes saved")
    assert saved < saved_default
    assert torch._functorch.config.activation_memory_budget == 1.0


def test_no_graph_break_when_a_region_is_traced_before_the_kernels_load(monkeypatch):
    """Session 12 found dynamo tracing the first load of csrc/ (its file checks and hashing) inside the
    first compiled layer: a graph break and a page of warnings.  Now each compiled region loads it before
    its first CUDA call, and a region traced before any load falls back to the PyTorch SwiGLU instead of
    tracing the build.  A process that has not loaded csrc/ yet is simulated (the module is not imported
    twice: the "first load" hands back the one already built)."""
    from torch._dynamo.utils import counters

    from hf_megatron import kernels
    from hf_megatron.kernels import build, ops
    extension = build.load_extension()
    assert extension is not None
    monkeypatch.setattr(build, "_extension", None)
    monkeypatch.setattr(build, "_build", lambda: extension)
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(4, 2 * 64, device="cuda", dtype=torch.bfloat16)
    explanation = torch._dynamo.explain(kernels.swiglu)(x)
    assert explanation.graph_break_count == 0 and not build.loaded()  # the PyTorch expression, no traced load

    calls = []

    class Counting:  # the extension, counting the SwiGLU forwards the compiled layers run
        def __getattr__(self, name):
            calls.append(name)
            return getattr(extension, name)

    monkeypatch.setattr(ops, "load_extension", Counting)
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    model = build_model(tiny_hf_model("llama"), dtype=torch.bfloat16, device="cuda", compile=True)
    _loss_and_grads(model, ids)
    assert build.loaded() and calls.count("swiglu_forward") >= len(model.decoder.layers)  # loaded before tracing
    # the loss region's own break (the csrc cross entropy is torch.compiler.disable'd) is by design
    untraceable = [reason for reason in counters["graph_break"] if "does not know how to trace" in reason]
    assert not untraceable, untraceable
