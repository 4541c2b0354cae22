"""The tokenizer travels: `hf-megatron train` from an HF folder stores its tokenizer in
`<save>/tokenizer` (named in the checkpoint's Megatron args), and `convert megatron-to-hf` of the
training folder gives an HF folder whose tokenizer transformers loads and that encodes as the
original; a tokenizer bigger than the model's vocabulary is refused before training."""
import pytest
from transformers import AutoTokenizer

from hf_megatron import cli
from hf_megatron.checkpoint.unpickle import safe_load
from test_convert_helpers import make_tokenizer
from tiny import tiny_config
from train_cli import base_args, cli_inprocess, last_line, make_workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("train_tokenizer"), documents=60)
    make_tokenizer(root / "config")  # 280 ids, below the tiny model's 300
    return root


def test_tokenizer_goes_into_the_checkpoint_and_back_to_hf(workspace, capsys):
    code, out, err = cli_inprocess(*base_args(workspace, 2, "--save", workspace / "run"))
    assert code == 0, err
    stored = workspace / "run" / "tokenizer"
    assert (stored / "tokenizer.json").is_file()
    args = safe_load(workspace / "run" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model == str(stored.absolute())
    assert cli.main(["convert", "megatron-to-hf", "--megatron", str(workspace / "run"),
                     "--out", str(workspace / "hf_out")]) == 0
    original = AutoTokenizer.from_pretrained(workspace / "config")
    converted = AutoTokenizer.from_pretrained(workspace / "hf_out")
    text = "the quick brown fox"
    assert converted(text)["input_ids"] == original(text)["input_ids"]


def test_tokenizer_larger_than_the_vocabulary_is_refused(workspace, tmp_path):
    folder = tmp_path / "small_vocab"
    tiny_config("llama", vocab_size=200).save_pretrained(folder)
    make_tokenizer(folder)  # 280 ids > 200 rows
    args = base_args(workspace, 1, config=False)
    code, out, err = cli_inprocess("--hf-config", folder, *args)
    assert code == 2 and "the tokenizer produces ids up to 279" in last_line(err) and "200 rows" in last_line(err)


def test_hf_to_megatron_carries_a_given_tokenizer_and_leaves_no_empty_folder(workspace, tmp_path):
    from tiny import tiny_hf_model
    hf = tmp_path / "hf"
    tiny_hf_model("llama").save_pretrained(hf)  # weights, no tokenizer files
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "bare")]) == 0
    assert not (tmp_path / "bare" / "tokenizer").exists()
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "with"),
                     "--tokenizer", str(workspace / "config")]) == 0
    assert (tmp_path / "with" / "tokenizer" / "tokenizer.json").is_file()
    assert cli.main(["reshard", "--src", str(tmp_path / "with"), "--out", str(tmp_path / "tp2"), "--tp", "2"]) == 0
    text = "a lazy dog"
    assert AutoTokenizer.from_pretrained(tmp_path / "tp2" / "tokenizer")(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(workspace / "config")(text)["input_ids"]
