"""The two per-step host-to-GPU copies removed in session 10 (tests/test_host_syncs_gpu.py checks the
step on a GPU): the rotary tables are copied to a device once, and the PP=1 loop's sums start from
the first micro batch's own tensors."""
import torch

from hf_megatron.model.rotary import RotaryEmbedding
from hf_megatron.parallel import pipeline


def test_rotary_tables_are_copied_to_a_device_once(monkeypatch):
    rotary = RotaryEmbedding(16, 10000.0)
    copies = []
    original = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copies.append(self is rotary.inv_freq)
                        or original(self, *a, **k))
    positions = torch.arange(8)[None]
    first = rotary(positions, torch.float32)
    second = rotary(positions, torch.float32)
    assert copies.count(True) == 1  # the host table went to the positions' device once, not per call
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert rotary._on(torch.device("cpu"), "inv_freq") is rotary._on(torch.device("cpu"), "inv_freq")


class _Out:
    def __init__(self, loss_sum, num_tokens):
        self.loss_sum, self.num_tokens = loss_sum, num_tokens


def test_plain_loop_sums_on_the_losses_device():
    values = iter([(torch.tensor(1.5), torch.tensor(3)), (torch.tensor(2.25), torch.tensor(4))])
    model = lambda *args, **kwargs: _Out(*next(values))  # noqa: E731
    micro = [{"input_ids": torch.zeros(1, 2, dtype=torch.long), "targets": torch.zeros(1, 2, dtype=torch.long)}] * 2
    out = pipeline._plain_loop(model, micro, 1.0, forward_only=True)
    assert out["loss_sum"].dtype == torch.float32 and out["loss_sum"].item() == 3.75
    assert out["num_tokens"].dtype == torch.long and out["num_tokens"].item() == 7
    empty = pipeline._plain_loop(model, [], 1.0, forward_only=True)
    assert empty["loss_sum"].item() == 0 and empty["num_tokens"].dtype == torch.long
