"""`hf-megatron train` with Megatron-LM's model-shape flags (--num-layers, --hidden-size, ...) instead
of a config.json, and the CLI's parser taking flags only as spelled (Megatron-LM's allow_abbrev=False).

The reference for each shape is a transformers config written by hand from Megatron-LM's rules
(ffn = int(8h/3 / 64) x 64 with --swiglu, 4h without; kv heads = --num-query-groups; positions =
--seq-length): the same run from that config.json must train to the same losses, and the converted
folder must load in transformers as that class."""
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
from train_cli import base_args, cli_inprocess, cli_subprocess, last_line, make_workspace

from hf_megatron import cli
from tiny import VOCAB

SHAPE = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4]
LLAMA = [*SHAPE, "--group-query-attention", "--num-query-groups", 2, "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--rotary-base", 500000, "--norm-epsilon", 1e-6]
NO_DROPOUT = ["--hidden-dropout", 0, "--attention-dropout", 0]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("model_flags"))


def _losses(folder):
    summary = json.loads((folder / "training_summary.json").read_text())
    return summary["first_loss"], summary["final_loss"]


def _train(root, save, *model):
    code, out, err = cli_inprocess(*base_args(root, 3, *model, "--save", save, config=False))
    assert code == 0, err[-3000:]
    return out


def _to_hf(root, megatron, name):
    assert cli.main(["convert", "megatron-to-hf", "--megatron", str(megatron), "--out", str(root / name)]) == 0
    return AutoModelForCausalLM.from_pretrained(root / name)


@pytest.mark.parametrize("flags, reference", [
    (LLAMA, LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                        rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False)),
    (SHAPE, GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=256, n_positions=32,
                       activation_function="gelu", layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0)),
], ids=["llama", "gpt2"])
def test_model_flags_train_as_the_transformers_config_megatron_lm_implies(workspace, tmp_path, flags, reference):
    reference.save_pretrained(tmp_path / "reference")
    _train(workspace, tmp_path / "from_json", "--hf-config", tmp_path / "reference", *NO_DROPOUT)
    _train(workspace, tmp_path / "from_flags", *flags, "--vocab-size", VOCAB, *NO_DROPOUT)
    assert _losses(tmp_path / "from_flags") == _losses(tmp_path / "from_json")
    model = _to_hf(tmp_path, tmp_path / "from_flags", "hf")
    expected = reference.to_dict()
    got = model.config.to_dict()
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "n_inner", "max_position_embeddings", "n_positions", "rms_norm_eps",
                "layer_norm_epsilon", "tie_word_embeddings", "activation_function", "hidden_act"):
        if key in expected:
            assert got[key] == expected[key], key
    assert type(model).__name__ == ("LlamaForCausalLM" if reference.model_type == "llama" else "GPT2LMHeadModel")


def test_model_flags_default_to_megatron_lm_dropout_and_a_resume_needs_none_of_them(workspace, tmp_path):
    out = _train(workspace, tmp_path / "run", *SHAPE, "--vocab-size", VOCAB, "--lr-decay-iters", 4)
    args = dict(re.findall(r"^\s+(\w+) \.+ (\S+)$", out, flags=re.M))
    assert float(args["hidden_dropout"]) == 0.1 and float(args["attention_dropout"]) == 0.1
    # a resumed run needs no model flags: the checkpoint holds the model
    code, _, err = cli_inprocess(*base_args(workspace, 4, "--load", tmp_path / "run", "--save", tmp_path / "run",
                                            "--lr-decay-iters", 4, config=False))
    assert code == 0, err[-2000:]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


@pytest.mark.parametrize("argv, fragment", [
    (["--swiglu", "--hf-config", "x"], "the model flags --swiglu need --num-layers, --hidden-size, "
                                       "--num-attention-heads as well"),
    ([*SHAPE, "--hf-config", "x"], "--hf-config and the model flags"),
    ([*SHAPE, "--position-embedding-type", "rope", "--vocab-size", 10],
     "the model flags' architecture (normalization=LayerNorm, position_embedding_type=rope, swiglu=False) "
     "matches none of"),
    ([*SHAPE, "--position-embedding-type", "alibi"], "expected one of learned_absolute, rope, got 'alibi'"),
    (["--num-layers", 2, "--hidden-size", 65, "--num-attention-heads", 4], "expected a multiple of "
                                                                            "--num-attention-heads 4"),
    ([*SHAPE, "--group-query-attention", "--num-query-groups", 3], "expected a divisor of --num-attention-heads"),
    (SHAPE, "give --vocab-size N or --tokenizer-model"),
    # GPT-2 (LayerNorm + learned positions) silently dropped these
    ([*SHAPE, "--kv-channels", 8, "--vocab-size", 10], "GPT-2 family (LayerNorm + learned positions) has no "
                                                       "kv_channels 8 (--kv-channels); Megatron-LM would build heads "
                                                       "of 8 channels, GPT-2's are hidden / heads = 16"),
    ([*SHAPE, "--group-query-attention", "--num-query-groups", 2, "--vocab-size", 10], "has no num_query_groups 2"),
    ([*SHAPE, "--qk-layernorm", "--vocab-size", 10], "has no qk_layernorm (--qk-layernorm)"),
])
def test_bad_model_flags_are_one_line(workspace, tmp_path, argv, fragment):
    code, _, err = cli_inprocess(*base_args(workspace, 2, *argv, "--save", tmp_path / "s", config=False))
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and fragment in last_line(err), err


def test_gpt2_shaped_flags_accept_gpt2s_own_head_size_and_groups(workspace, tmp_path):
    from hf_megatron.training.model_flags import hf_config_of_flags
    from hf_megatron.training.config import RunConfig
    run = RunConfig(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16, group_query_attention=True,
                    num_query_groups=4, vocab_size=10, data_path=["x"], seq_length=32)
    assert hf_config_of_flags(run, None)["model_type"] == "gpt2"


def test_flags_are_taken_only_as_spelled(workspace, tmp_path):
    # argparse's default would read --train-iter as --train-iters, and call --num-layers ambiguous
    code, _, err = cli_subprocess(*base_args(workspace, None, "--train-iter", 2, "--save", tmp_path / "s"))
    assert code == 2 and "unrecognized arguments: --train-iter 2" in err, err
    code, _, err = cli_subprocess("--num-layers-at-start", 1, *base_args(workspace, 2, "--save", tmp_path / "s"))
    assert code == 2 and "unrecognized arguments: --num-layers-at-start 1" in err, err
    assert not (tmp_path / "s").exists()


def test_megatron_lm_pretrain_gpt_command_line_runs_unchanged(tmp_path):
    """The shape of Megatron-LM's examples/pretrain_gpt.sh (GPT_ARGS, DATA_ARGS with GPT-2 vocab and
    merge files, OUTPUT_ARGS, --save/--load the same folder), tiny sizes, on this CPU with gloo."""
    import numpy as np
    from test_convert_helpers import make_tokenizer

    from hf_megatron.data import IndexedDatasetWriter
    make_tokenizer(tmp_path / "tok").backend_tokenizer.model.save(str(tmp_path), "gpt2")
    entries = json.loads((tmp_path / "gpt2-vocab.json").read_text())  # GPT-2's vocab.json holds its EOD
    entries.setdefault("<|endoftext|>", len(entries))
    (tmp_path / "gpt2-vocab.json").write_text(json.dumps(entries))
    ids = len(entries)
    with IndexedDatasetWriter(str(tmp_path / "corpus_text_document"), dtype=np.uint16) as writer:
        for doc in np.random.default_rng(0).integers(0, ids, size=(80, 40)):
            writer.add_item(doc)
            writer.end_document()
    gpt_args = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 32,
                "--max-position-embeddings", 32, "--micro-batch-size", 2, "--global-batch-size", 4, "--lr", 0.00015,
                "--train-iters", 4, "--lr-decay-iters", 3, "--lr-decay-style", "cosine", "--min-lr", 1.0e-5,
                "--weight-decay", 1e-2, "--lr-warmup-fraction", .01, "--clip-grad", 1.0]
    data_args = ["--data-path", tmp_path / "corpus_text_document", "--vocab-file", tmp_path / "gpt2-vocab.json",
                 "--merge-file", tmp_path / "gpt2-merges.txt", "--tokenizer-type", "GPT2BPETokenizer",
                 "--split", "949,50,1"]
    output_args = ["--log-interval", 2, "--save-interval", 2, "--eval-interval", 2, "--eval-iters", 1]
    run = [*gpt_args, *data_args, *output_args, "--distributed-backend", "gloo", "--save", tmp_path / "ckpt",
           "--load", tmp_path / "ckpt"]
    code, out, err = cli_inprocess(*run)
    assert code == 0, err[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert "validation loss at iteration 4" in out
    model = _to_hf(tmp_path, tmp_path / "ckpt", "hf")
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_positions == 32
    if not torch.cuda.is_available():  # nccl needs GPUs: one line, nothing written
        code, _, err = cli_inprocess(*run[:-4], "--distributed-backend", "nccl", "--save", tmp_path / "other")
        assert code == 2 and "--distributed-backend nccl): expected CUDA GPUs" in last_line(err), err
        assert not (tmp_path / "other").exists()
