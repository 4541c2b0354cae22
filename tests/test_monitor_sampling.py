"""Text samples (training/sampling.py) against transformers itself: the same weights give the
same greedy continuation, and the same temperature draws, in one process and at tp=2 with
sequence parallelism and pp=2 (one 2-process run, default); tp=2 x pp=2 and interleaved pp=2 x
vpp=2 (4 processes, slow)."""
import pytest
import torch

from dist import run_distributed
from hf_megatron.loading import build_model, build_model_chunks
from hf_megatron.parallel import state
from hf_megatron.training.sampling import generate_ids, window_length
from tiny import tiny_hf_model

PROMPT = [5, 17, 42, 99, 7]
NEW = 12


def hf_continuation(model, prompt, new, temperature=0.0, seed=0):
    """Step-by-step continuation with transformers' forward (no cache, no generate() rules)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new):
            logits = model(ids).logits[0, -1].float()
            if temperature > 0:
                token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
            else:
                token = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_and_temperature_samples_equal_transformers(arch):
    state.reset()
    hf = tiny_hf_model(arch).eval()
    chunk = build_model(hf)
    assert generate_ids([chunk], PROMPT, NEW) == hf_continuation(hf, PROMPT, NEW)
    assert generate_ids([chunk], PROMPT, NEW, temperature=1.5, seed=3) == hf_continuation(hf, PROMPT, NEW, 1.5, 3)


def test_window_stops_at_the_model_positions():
    assert window_length(5, 12, 64, 1) == 17
    assert window_length(5, 12, 64, 4) == 20  # a multiple of tp under sequence parallelism
    assert window_length(60, 12, 64, 1) == 64
    assert window_length(60, 12, 62, 4) == 60  # rounded down when rounding up would pass the positions
    state.reset()
    hf = tiny_hf_model("llama").eval()  # 64 positions: only 64 - 60 tokens fit after a 60-token prompt
    long_prompt = [(7 * i) % 300 for i in range(60)]
    assert generate_ids([build_model(hf)], long_prompt, NEW) == hf_continuation(hf, long_prompt, 4)


def _sample_in_layouts(rank, world, layouts, arch, overrides):
    hf = tiny_hf_model(arch, **overrides).eval()
    out = []
    for tp, pp, vpp, sp, temperature in layouts:
        state.initialize(tp=tp, pp=pp)
        chunks = build_model_chunks(hf, vpp=vpp, sequence_parallel=sp)
        out.append(generate_ids(chunks, PROMPT, NEW, temperature=temperature, seed=3))
    return out


def _check(layouts, world, arch="llama", **overrides):
    """layouts: (tp, pp, vpp, sequence parallel, temperature); every rank must return transformers' ids."""
    results = run_distributed(_sample_in_layouts, world, args=(layouts, arch, overrides))
    hf = tiny_hf_model(arch, **overrides).eval()
    expected = [hf_continuation(hf, PROMPT, NEW, temperature, 3) for *_, temperature in layouts]
    for rank, per_rank in enumerate(results):
        assert per_rank == expected, f"rank {rank}"


def test_samples_at_tp2_sp_and_pp2_equal_transformers():
    _check([(2, 1, 1, True, 1.5), (1, 2, 1, False, 0.0)], world=2)


@pytest.mark.slow
def test_samples_at_tp2_pp2_and_interleaved_equal_transformers():
    _check([(2, 2, 1, True, 0.0), (2, 2, 1, True, 1.5), (1, 4, 1, False, 0.0), (2, 2, 2, False, 1.5)],
           world=4, num_hidden_layers=8)
