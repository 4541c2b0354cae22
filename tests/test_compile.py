"""Regional torch.compile (`parallel.compile.apply_compile`) changes speed, not numbers.

Backend: "aot_eager" -- dynamo's graph capture plus AOTAutograd's joint forward/backward graph
and its partitioner (everything compile does to autograd, recompute and collectives), run by
eager kernels.  Inductor's code generation is left out: on this 2-core CPU it spends ~60 s in
the C++ compiler for one tiny model (the slow-marked test runs it once).  A counting backend
checks that the regions really are compiled (a silent eager fallback would pass any parity test).
"""
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dist import run_distributed
from hf_megatron.loading import build_model
from hf_megatron.parallel import apply_compile, apply_recompute
from tiny import rel_err, tiny_hf_model
from training_helpers import make_batches, training_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from recompute_memory import saved_bytes  # noqa: E402  (bytes autograd keeps for backward)

TOL = 1e-5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # compiled graphs are cached per code object: no reuse across tests
    yield
    torch._dynamo.reset()


def forward_backward(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(ids, targets=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def assert_same(compiled, eager):
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = compiled, eager
    assert rel_err(logits, ref_logits) <= TOL
    assert rel_err(loss, ref_loss) <= TOL
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) <= TOL, name


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_layers_give_eager_logits_loss_and_grads(arch, recompute):
    from hf_megatron.parallel.random import get_tracker
    get_tracker().set_states({})  # an earlier test may have seeded the TP stream: its clones add graph breaks
    hf = tiny_hf_model(arch)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = build_model(hf, recompute=recompute)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = build_model(hf, recompute=recompute, compile={"backend": counter})
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert_same(forward_backward(compiled, ids), forward_backward(eager, ids))
    # one graph shared by both layers + one for the loss; selective recompute breaks the layer
    # graph around the checkpointed core attention into 4 pieces (parallel/compile.py says why)
    assert counter.frame_count == (5 if recompute == "selective" else 2)
    assert_same(forward_backward(compiled, ids), forward_backward(eager, ids))  # second step: cached graphs
    assert counter.frame_count == (5 if recompute == "selective" else 2)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoder_scope_is_one_region_with_eager_numbers(arch):
    """scope "decoder": the whole layer stack + final norm is one compiled graph (plus the loss's),
    same logits, loss and grads as eager, and the param-gather hook regions follow the scope."""
    from hf_megatron.parallel.compile import compiled_regions
    hf = tiny_hf_model(arch)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = build_model(hf)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = build_model(hf, compile={"backend": counter, "scope": "decoder"})
    assert [n for n, _ in compiled_regions(compiled)] == ["decoder", "vocab_loss"]
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert_same(forward_backward(compiled, ids), forward_backward(eager, ids))
    assert counter.frame_count == 2  # the decoder (both layers unrolled) and the loss


def test_decoder_scope_refuses_recompute_either_way():
    hf = tiny_hf_model("llama")
    with pytest.raises(ValueError, match="scope 'decoder' with activation recompute applied"):
        apply_compile(apply_recompute(build_model(hf), "selective"), backend="aot_eager", scope="decoder")
    with pytest.raises(ValueError, match="cannot be applied inside a decoder compiled as one region"):
        apply_recompute(apply_compile(build_model(hf), backend="aot_eager", scope="decoder"), "full")
    with pytest.raises(ValueError, match="already compiled with scope 'layer'"):
        apply_compile(apply_compile(build_model(hf), backend="aot_eager"), backend="aot_eager", scope="decoder")


def test_decoder_scope_flag_needs_compile_and_no_recompute():
    from hf_megatron.errors import ConfigError
    from hf_megatron.training import TrainingConfig
    assert TrainingConfig(torch_compile=True, torch_compile_scope="decoder").torch_compile_scope == "decoder"
    with pytest.raises(ConfigError, match="expected torch compile on, got --no-torch-compile"):
        TrainingConfig(torch_compile=False, torch_compile_scope="decoder")
    assert TrainingConfig(torch_compile_scope="decoder").compiles("cpu")  # asks for compile, also on CPU
    with pytest.raises(ConfigError, match="expected no --recompute-granularity"):
        TrainingConfig(torch_compile=True, torch_compile_scope="decoder", recompute_granularity="full")


def test_state_dict_names_unchanged_and_compile_goes_inside_recompute():
    hf = tiny_hf_model("llama")
    model = build_model(hf)
    names = list(model.state_dict())
    apply_compile(model, backend="aot_eager")
    apply_compile(model, backend="aot_eager")  # idempotent
    apply_recompute(model, "full")
    assert list(model.state_dict()) == names
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in build_model(hf).named_parameters()]
    recomputed_first = apply_recompute(build_model(hf), "full")
    with pytest.raises(ValueError, match="apply_compile first, then apply_recompute"):
        apply_compile(recomputed_first, backend="aot_eager")


def _train_one_step(arch: str, compile):
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model as build_chunks, build_optimizer, setup_parallel, split_batch, \
        train_step
    from tiny import engine_batch
    cfg = training_config({})
    setup_parallel(cfg)
    try:
        chunks = build_chunks(tiny_hf_model(arch), cfg, compile=compile)
        optimizer = build_optimizer(chunks, cfg)
        stats = train_step(chunks, optimizer, None, split_batch(engine_batch(make_batches(1)[0]), cfg))
        return stats, {k: v.detach().clone() for k, v in chunks[0].state_dict().items()}
    finally:
        state.reset()


@pytest.mark.parametrize("scope", ["layer", "decoder"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_model_trains_one_step_like_eager(arch, scope):
    counter = CompileCounterWithBackend("aot_eager")
    stats, weights = _train_one_step(arch, {"backend": counter, "scope": scope})
    ref_stats, ref_weights = _train_one_step(arch, False)
    assert counter.frame_count >= 2
    assert abs(stats["loss"] - ref_stats["loss"]) <= TOL * ref_stats["loss"]
    assert abs(stats["grad_norm"] - ref_stats["grad_norm"]) <= TOL * ref_stats["grad_norm"]
    for name, weight in ref_weights.items():
        assert rel_err(weights[name], weight) <= TOL, name


def _tp_worker(rank, world):
    from hf_megatron.parallel import state
    from hf_megatron.parallel.random import model_parallel_seed
    state.initialize(tp=world)
    model_parallel_seed(1234)  # seeded TP RNG stream: its forks are graph breaks, still exact
    hf = tiny_hf_model("llama")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = build_model(hf, sequence_parallel=True, compile={"backend": counter})
    eager = build_model(hf, sequence_parallel=True)
    assert_same(forward_backward(compiled, ids), forward_backward(eager, ids))
    return counter.frame_count


def test_compile_composes_with_tensor_and_sequence_parallel():
    assert all(frames >= 2 for frames in run_distributed(_tp_worker, 2))


@pytest.mark.slow
def test_inductor_compiled_layers_match_eager():
    hf = tiny_hf_model("gpt2")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    assert_same(forward_backward(build_model(hf, compile=True), ids), forward_backward(build_model(hf), ids))


def test_memory_budget_recomputes_instead_of_saving_with_eager_numbers():
    """--activation-memory-budget: AOTAutograd's partitioner (aot_eager runs it as inductor would)
    keeps fewer activations, the numbers stay eager's, and torch's global setting is left alone."""
    hf = tiny_hf_model("llama")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = build_model(hf)
    default = build_model(hf, compile={"backend": "aot_eager"})
    forward_backward(default, ids)
    saved_default = saved_bytes(default, ids)
    torch._dynamo.reset()  # dynamo shares a layer's compiled graph between models of one process
    budget = build_model(hf, compile={"backend": "aot_eager", "memory_budget": 0.5})
    assert_same(forward_backward(budget, ids), forward_backward(eager, ids))
    assert saved_bytes(budget, ids) < 0.8 * saved_default
    assert torch._functorch.config.activation_memory_budget == 1.0
    with pytest.raises(ValueError, match="memory_budget should be > 0 and < 1"):
        apply_compile(build_model(hf), memory_budget=1.0)


def test_memory_budget_flag_needs_compile():
    from hf_megatron.errors import ConfigError
    with pytest.raises(ConfigError, match=r"activation_memory_budget \(--activation-memory-budget 0.5\): "
                                          "expected torch compile on, got --no-torch-compile"):
        training_config({}, torch_compile=False, activation_memory_budget=0.5)
    assert training_config({}, activation_memory_budget=0.5).compiles("cpu")
    for bad in (0.0, 1.0):
        with pytest.raises(ConfigError, match="activation_memory_budget"):
            training_config({}, torch_compile=True, activation_memory_budget=bad)
    assert training_config({}, torch_compile=True, activation_memory_budget=0.5).activation_memory_budget == 0.5


def test_compile_is_on_by_default_for_a_cuda_model_only():
    """TrainingConfig.torch_compile unset: a model built for a CUDA device is compiled, one for the CPU
    is not; --torch-compile / --no-torch-compile decide either way (parsed as the CLI parses them)."""
    import argparse
    from hf_megatron.commands.flags import add_flags, configs_from_args
    from hf_megatron.training import TrainingConfig
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainingConfig)

    def parsed(*flags):
        return configs_from_args(parser.parse_args(["--micro-batch-size", "1", *flags]), TrainingConfig)[0]

    unset, on, off = parsed(), parsed("--torch-compile"), parsed("--no-torch-compile")
    assert (unset.torch_compile, on.torch_compile, off.torch_compile) == (None, True, False)
    assert [cfg.compiles(d) for cfg in (unset, on, off) for d in ("cuda", torch.device("cuda", 1), "cpu", None)] == \
        [True, True, False, False, True, True, True, True, False, False, False, False]


def _pp_worker(rank, world, layout):
    """Two steps of one pipeline layout, compiled (aot_eager, counted) and eager, from the same weights."""
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model as build_chunks, build_optimizer, build_scheduler, setup_parallel, \
        split_batch, train_step
    from tiny import engine_batch
    from training_helpers import global_state_dict, layer_kwargs
    out, keep_alive = {}, []
    for name in ("compiled", "eager"):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        cfg = training_config(layout)
        setup_parallel(cfg)
        chunks = build_chunks(tiny_hf_model("llama", **layer_kwargs("llama")), cfg,
                              compile={"backend": counter} if name == "compiled" else False)
        keep_alive.append(chunks)  # the pipeline caches schedules by chunk id: no id reuse
        optimizer = build_optimizer(chunks, cfg)
        scheduler = build_scheduler(optimizer, cfg)
        losses = [train_step(chunks, optimizer, scheduler, split_batch(engine_batch(b), cfg))["loss"]
                  for b in make_batches(2)]
        out[name] = {"losses": losses, "state": global_state_dict(chunks), "frames": counter.frame_count}
        state.reset()
    return out


@pytest.mark.parametrize("layout", [{"pp": 2}, pytest.param({"pp": 2, "vpp": 2}, marks=pytest.mark.slow)])
def test_compile_composes_with_pipeline_parallel(layout):
    """Compile is the CUDA default, so every layout must keep the eager numbers compiled: pp=2, and the
    interleaved schedule (two chunks per stage), each stage's layers compiled."""
    for result in run_distributed(_pp_worker, 2, (layout,)):
        compiled, eager = result["compiled"], result["eager"]
        assert compiled["frames"] >= 1 and eager["frames"] == 0
        for a, b in zip(compiled["losses"], eager["losses"]):
            assert abs(a - b) <= TOL * abs(b)
        assert compiled["state"].keys() == eager["state"].keys()
        for name, weight in eager["state"].items():
            assert rel_err(compiled["state"][name], weight) <= TOL, name


def _broken_backend(gm, example_inputs):
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


@pytest.mark.parametrize("fused_loss", [False, True])
def test_a_failed_default_compile_warns_once_and_trains_eager(fused_loss):
    """compile is the CUDA default: where it cannot run (triton without a C compiler, a GPU too old for
    triton), `fallback` warns once and every region runs eager with eager's numbers; asked for
    explicitly (no fallback), the failure is raised."""
    hf = tiny_hf_model("llama")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = forward_backward(build_model(hf, fused_loss=fused_loss), ids)
    model = build_model(hf, fused_loss=fused_loss, compile={"backend": _broken_backend, "fallback": True})
    with pytest.warns(UserWarning, match=r"torch.compile failed here \(RuntimeError: Failed to find C compiler") as seen:
        first = forward_backward(model, ids)
    assert sum("torch.compile failed" in str(w.message) for w in seen) == 1
    assert_same(first, eager)
    assert_same(forward_backward(model, ids), eager)  # and eager from then on
    strict = build_model(hf, fused_loss=fused_loss, compile={"backend": _broken_backend})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="Failed to find C compiler"):
        forward_backward(strict, ids)


def test_only_the_default_compile_falls_back(monkeypatch):
    """trainer.build_model: compile by default (torch_compile unset; here asked for on CPU by the decoder
    scope) falls back to eager on a failed compile; --torch-compile given raises it."""
    import hf_megatron.parallel.compile as compile_module
    from hf_megatron.training import TrainingConfig, build_model as build_chunks, setup_parallel
    from hf_megatron.parallel import state
    real = torch.compile
    monkeypatch.setattr(compile_module.torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": _broken_backend}))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for asked in (None, True):
        cfg = TrainingConfig(torch_compile=asked, torch_compile_scope="decoder")
        setup_parallel(cfg)
        try:
            chunk = build_chunks(tiny_hf_model("llama"), cfg, device="cpu")[0]
            if asked:
                with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
                    forward_backward(chunk, ids)
            else:
                with pytest.warns(UserWarning, match="the model runs eager from now on"):
                    forward_backward(chunk, ids)
        finally:
            state.reset()


def test_a_region_loads_the_kernels_before_its_first_cuda_call(monkeypatch):
    """A compiled region loads csrc/ eagerly before its first call with CUDA tensors: a first load under
    dynamo's tracing (file checks, hashing, the build) would graph-break the layer region that calls the
    SwiGLU op.  CPU calls (and HF_MEGATRON_KERNELS=0, or an extension already loaded) load nothing."""
    from hf_megatron import kernels
    from hf_megatron.parallel.compile import _kernels_loaded_first

    class LooksCuda(torch.Tensor):  # a CPU tensor that answers is_cuda like a GPU one
        @property
        def is_cuda(self):
            return True

    calls = []
    monkeypatch.setattr(kernels, "load_extension", lambda: calls.append("load"))
    model = build_model(tiny_hf_model("llama"))
    apply_compile(model, backend="aot_eager")
    forward_backward(model, torch.randint(0, 300, (2, 8)))
    assert calls == []  # CPU tensors: nothing to load
    region = _kernels_loaded_first(lambda x, scale=None: x)
    x = torch.zeros(3)
    assert region(x) is x and calls == []
    region(x, scale=torch.zeros(1).as_subclass(LooksCuda))
    assert calls == ["load"]
    monkeypatch.setenv("HF_MEGATRON_KERNELS", "0")
    region(torch.zeros(1).as_subclass(LooksCuda))
    assert calls == ["load"]
    monkeypatch.delenv("HF_MEGATRON_KERNELS")
    monkeypatch.setattr(kernels, "loaded", lambda: True)
    region(torch.zeros(1).as_subclass(LooksCuda))
    assert calls == ["load"]
