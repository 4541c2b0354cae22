"""`hf-megatron train` with Megatron-LM's model-shape flags (--num-layers, --hidden-size, ...) instead
of a config.json, and the CLI's parser taking flags only as spelled (Megatron-LM's allow_abbrev=False).

The reference for each shape is a transformers config written by hand from Megatron-LM's rules
(ffn = int(8h/3 / 64) x 64 with --swiglu, 4h without; kv heads = --num-query-groups; positions =
--seq-length): the same run from that config.json must train to the same losses, and the converted
folder must load in transformers as that class."""
import json
import re

import pytest
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
])
def test_bad_model_flags_are_one_line(workspace, tmp_path, argv, fragment):
    code, _, err = cli_inprocess(*base_args(workspace, 2, *argv, "--save", tmp_path / "s", config=False))
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and fragment in last_line(err), err


def test_flags_are_taken_only_as_spelled(workspace, tmp_path):
    # argparse's default would read --train-iter as --train-iters, and call --num-layers ambiguous
    code, _, err = cli_subprocess(*base_args(workspace, None, "--train-iter", 2, "--save", tmp_path / "s"))
    assert code == 2 and "unrecognized arguments: --train-iter 2" in err, err
    code, _, err = cli_subprocess("--num-layers-at-start", 1, *base_args(workspace, 2, "--save", tmp_path / "s"))
    assert code == 2 and "unrecognized arguments: --num-layers-at-start 1" in err, err
    assert not (tmp_path / "s").exists()
