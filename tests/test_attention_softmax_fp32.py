"""Megatron-LM's --attention-softmax-in-fp32 is accepted by `train` with no effect, because the
softmax is in fp32 here already: torch's softmax of a bf16 tensor equals Megatron-LM's fp32 softmax
followed by its cast back to bf16 (FusedScaleMaskSoftmax with softmax_in_fp32), and our attention
(scaled_dot_product_attention in bf16) is at least as close to the fp32 attention as that path."""
import pytest
import torch
import torch.nn.functional as F

from train_cli import base_args, cli_inprocess, make_workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("softmax_fp32"), documents=60)


def _megatron_attention(q, k, v, softmax_in_fp32: bool):
    """Megatron-LM's unfused core attention: bf16 scores, the softmax in fp32 (or in the input dtype),
    the probabilities cast to bf16 for the product with v."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = F.softmax(scores.float() if softmax_in_fp32 else scores, dim=-1).to(q.dtype)
    return probs @ v


def test_the_softmax_is_fp32_already():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64) * 2 for _ in range(3))
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    fp32_softmax = _megatron_attention(qb, kb, vb, softmax_in_fp32=True)
    assert torch.equal(_megatron_attention(qb, kb, vb, softmax_in_fp32=False), fp32_softmax)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ours = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    assert (ours.float() - exact).abs().max() <= (fp32_softmax.float() - exact).abs().max()


def test_train_accepts_the_flag_and_trains_the_same_losses(workspace, tmp_path):
    runs = {}
    for name, extra in (("plain", []), ("flag", ["--attention-softmax-in-fp32"])):
        code, out, err = cli_inprocess(*base_args(workspace, 2, "--bf16", "--save", tmp_path / name, *extra))
        assert code == 0, err[-2000:]
        runs[name] = [line.split("lm loss:")[1].split("|")[0].strip() for line in out.splitlines() if "lm loss:" in line]
    assert runs["flag"] == runs["plain"] and len(runs["plain"]) == 2
