"""`hf-megatron train --load` refusals a Megatron-LM user expects (checkpointing.py's
check_checkpoint_args and load_checkpoint): model flags that contradict the checkpoint, GPT-2-shaped
flags the family cannot honour, iter_* folders without a tracker, and --ckpt-step."""
import pytest
from train_cli import base_args, cli_inprocess, error_line, make_workspace

from tiny import VOCAB

SHAPE = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--vocab-size", VOCAB,
         "--lr-decay-iters", 4]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("resume_checks"), documents=60)


@pytest.fixture(scope="module")
def checkpoint(workspace):
    """A 4-head GPT-2-shaped run from the model flags, saved at iterations 1 and 2."""
    save = workspace / "ck"
    code, _, err = cli_inprocess(*base_args(workspace, 2, *SHAPE, "--save", save, "--save-interval", 1,
                                            config=False))
    assert code == 0, err[-2000:]
    return save


def _resume(workspace, load, *extra, iters=3, save=None):
    return cli_inprocess(*base_args(workspace, iters, *extra, "--load", load, "--save", save or load, config=False))


def test_a_model_flag_that_contradicts_the_checkpoint_is_refused(workspace, checkpoint):
    """8 heads give the 4-head checkpoint's qkv the same shape: it loaded and trained another model."""
    shape = [*SHAPE[:5], 8, *SHAPE[6:]]
    line = error_line(_resume(workspace, checkpoint, *shape))
    assert ("checkpoint's num_attention_heads is 4, the model flags make it 8 (--num-attention-heads)" in line
            and str(checkpoint) in line), line
    line = error_line(_resume(workspace, checkpoint, *SHAPE, "--normalization", "RMSNorm", "--swiglu",
                          "--position-embedding-type", "rope", "--disable-bias-linear"))
    assert "normalization is LayerNorm, the model flags make it RMSNorm (--normalization)" in line, line
    assert _tracker(checkpoint) == "2"


def _tracker(folder):
    return (folder / "latest_checkpointed_iteration.txt").read_text().strip()


def test_iter_folders_without_a_tracker_are_refused_not_overwritten(workspace, checkpoint, tmp_path):
    """Megatron-LM warns 'could not find the metadata file' and starts afresh; with --save there that
    run overwrote the saved iterations."""
    import shutil
    folder = tmp_path / "no_tracker"
    shutil.copytree(checkpoint, folder)
    (folder / "latest_checkpointed_iteration.txt").unlink()
    line = error_line(_resume(workspace, folder, *SHAPE))
    assert (f"--load {folder}: holds iter_0000001, iter_0000002 but no latest_checkpointed_iteration.txt" in line
            and "echo 2 > " in line), line
    assert sorted(p.name for p in folder.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    assert not (folder / "latest_checkpointed_iteration.txt").exists()


def test_ckpt_step_resumes_that_iteration_and_names_the_ones_there(workspace, checkpoint, tmp_path):
    """Megatron-LM's --ckpt-step N: iter_N instead of the tracker's iteration (2 here)."""
    code, out, err = _resume(workspace, checkpoint, "--ckpt-step", 1, "--lr-decay-iters", 4, save=tmp_path / "from1")
    assert code == 0, err[-2000:]
    assert f"resuming from {checkpoint} iteration 1" in out and "iteration      2/3" in out, out[-3000:]
    assert (tmp_path / "from1" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # --train-iters 2, which the tracker's iteration reaches but iteration 1 does not: one step to train
    code, out, err = _resume(workspace, checkpoint, "--ckpt-step", 1, "--lr-decay-iters", 4, iters=2,
                             save=tmp_path / "to2")
    assert code == 0 and "iteration      2/2" in out and "nothing to train" not in out, (out + err)[-3000:]
    line = error_line(_resume(workspace, checkpoint, "--ckpt-step", 5, save=tmp_path / "from5"))
    assert f"--ckpt-step 5: {checkpoint} has no iter_0000005; its iterations: iter_0000001, iter_0000002" in line
    assert not (tmp_path / "from5").exists()


def test_a_megatron_lm_checkpoint_knowing_only_its_padded_vocabulary_takes_the_tokenizers():
    """Megatron-LM's args hold padded_vocab_size (check_checkpoint_args compares that), not the tokenizer's."""
    from transformers import GPT2Config

    from hf_megatron.config import ModelConfig
    from hf_megatron.training.model_flags import check_flags_match_checkpoint

    def config(vocab):
        return ModelConfig.from_hf(GPT2Config(vocab_size=vocab, n_layer=2, n_embd=64, n_head=4, bos_token_id=0,
                                              eos_token_id=0))
    check_flags_match_checkpoint(config(VOCAB), config(384), "ck", resume=True)  # 300 pads to 384
    with pytest.raises(Exception, match=r"vocab_size is 300, the model flags make it 301 \(--vocab-size\)"):
        check_flags_match_checkpoint(config(301), config(VOCAB), "ck", resume=True)  # ours knows it exactly


def test_an_hf_config_that_contradicts_the_checkpoint_is_refused(workspace, tmp_path):
    """--hf-config on a resume is checked as the model flags are: same-shaped contradictions (8 heads of
    width 8 for 4 of width 16; another rope base) would load the weights into another model."""
    from tiny import tiny_config
    save = tmp_path / "ck"
    code, _, err = cli_inprocess(*base_args(workspace, 1, "--lr-decay-iters", 4, "--save", save))
    assert code == 0, err[-2000:]
    for field, value, overrides in [("num_attention_heads", "8", dict(num_attention_heads=8, num_key_value_heads=4,
                                                                      head_dim=8)),
                                    ("rotary_base", "10000", dict(rope_theta=10000.0))]:
        other = tmp_path / field
        tiny_config("llama", **overrides).save_pretrained(other)
        args = [a if a != workspace / "config" else other for a in base_args(workspace, 2, "--lr-decay-iters", 4,
                                                                              "--load", save, "--save", save)]
        line = error_line(cli_inprocess(*args))
        assert f"checkpoint's {field} is " in line and f"--hf-config {other} makes it {value}" in line, line
    assert _tracker(save) == "1"
    code, _, err = cli_inprocess(*base_args(workspace, 2, "--lr-decay-iters", 4, "--load", save, "--save", save))
    assert code == 0, err[-2000:]  # the checkpoint's own config resumes
    assert _tracker(save) == "2"
