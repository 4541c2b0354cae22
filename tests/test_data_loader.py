"""Per-dp-rank micro batches: Megatron-LM's MegatronPretrainingSampler order, resumption, the
window/label convention against transformers' loss, and rank-0-only index building under gloo."""
import numpy as np
import pytest
import torch

from dist import run_distributed
from hf_megatron.data import MegatronPretrainingSampler, batch_iterator, build_gpt_datasets


def megatron_lm_sampler(total, consumed, micro_batch_size, dp_rank, dp_size, drop_last=True):
    """Megatron-LM's MegatronPretrainingSampler.__iter__ (megatron/training/datasets/data_samplers.py,
    not shipped in the megatron-core wheel), restated as the reference."""
    batch, start = [], dp_rank * micro_batch_size
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == micro_batch_size * dp_size:
            yield batch[start:start + micro_batch_size]
            batch = []
    if batch and not drop_last:
        yield batch[start:start + micro_batch_size]


@pytest.mark.parametrize("total,consumed,mbs,dp", [(23, 0, 2, 3), (23, 12, 2, 3), (40, 8, 4, 2), (7, 0, 1, 1)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_matches_megatron_lm(total, consumed, mbs, dp, drop_last):
    for rank in range(dp):
        ours = list(MegatronPretrainingSampler(total, consumed, mbs, rank, dp, drop_last))
        reference = [b for b in megatron_lm_sampler(total, consumed, mbs, rank, dp, drop_last) if b]
        assert ours == reference


@pytest.fixture(scope="module")
def train_set(tmp_path_factory):
    from data_oracle import write_random_corpus  # here: spawned ranks need not import megatron

    root = tmp_path_factory.mktemp("loader")
    write_random_corpus(str(root / "c"), 200, seed=4, max_len=40, vocab=300)
    return build_gpt_datasets(str(root / "c"), "1", 12, 9, (100, None, None), cache_dir=str(root / "cache"))[0]


def test_batches_slice_global_order_and_resume(train_set):
    mbs, dp = 3, 2
    per_rank = [list(batch_iterator(train_set, mbs, r, dp)) for r in range(dp)]
    step = 0
    for rank_batches in zip(*per_rank):
        global_batch = torch.cat([b["input_ids"] for b in rank_batches])
        windows = torch.from_numpy(np.stack([train_set[k] for k in range(step, step + mbs * dp)]))
        assert torch.equal(global_batch, windows[:, :-1])
        assert torch.equal(torch.cat([b["targets"] for b in rank_batches]), windows[:, 1:])
        for b in rank_batches:
            assert b["input_ids"].dtype == torch.long and b["input_ids"].shape == (mbs, 12)
        step += mbs * dp
    assert step == len(train_set) // (mbs * dp) * mbs * dp
    resumed = list(batch_iterator(train_set, mbs, 1, dp, consumed_samples=4 * mbs * dp))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(resumed, per_rank[1][4:]))
    assert len(resumed) == len(per_rank[1]) - 4


def test_full_window_gives_megatron_targets_through_transformers_loss(train_set):
    """The seq+1 window as input_ids = window[:-1], targets = window[1:]: our model's loss
    equals Megatron's loss (inputs window[:-1], targets window[1:]) computed with transformers,
    over exactly seq_length targets per sample."""
    import hf_megatron
    from tiny import tiny_hf_model

    hf_model = tiny_hf_model("gpt2")
    model = hf_megatron.from_pretrained(hf_model)
    batch = next(batch_iterator(train_set, 2, 0, 1))
    window = torch.cat([batch["input_ids"], batch["targets"][:, -1:]], dim=1)
    out = model(batch["input_ids"], targets=batch["targets"])
    logits = hf_model(window[:, :-1]).logits
    megatron_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
    assert int(out.num_tokens) == 2 * train_set.seq_length
    assert abs(out.loss.item() - megatron_loss.item()) <= 1e-5 * abs(megatron_loss.item())


def _build_on_ranks(rank, world_size, prefix, cache_dir):
    train = build_gpt_datasets(prefix, "98,2", 12, 3, (150, 5, None), cache_dir=cache_dir)[0]
    first = next(batch_iterator(train, 2, rank, world_size))
    return {"loaded": isinstance(train.shuffle_index, np.memmap),
            "shuffle": torch.from_numpy(np.array(train.shuffle_index, dtype=np.int64)),
            "batch": first["input_ids"]}


def test_only_rank0_builds_the_indices(tmp_path):
    from data_oracle import write_random_corpus

    write_random_corpus(str(tmp_path / "c"), 300, seed=2, vocab=300)
    results = run_distributed(_build_on_ranks, 2, (str(tmp_path / "c"), str(tmp_path / "cache")))
    assert [r["loaded"] for r in results] == [False, True]  # rank 0 built, rank 1 read its files
    assert torch.equal(results[0]["shuffle"], results[1]["shuffle"])
    assert not torch.equal(results[0]["batch"], results[1]["batch"])  # each rank its own slice
