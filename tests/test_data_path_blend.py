"""`--data-path` lists: read as megatron-core's get_blend_from_list reads them (one prefix, prefixes,
or weight, prefix alternating); the lists it misreads are one line naming --data-path in `train` and
`evaluate` ('0.3 a 0.7' was a bare 'path not found' for a prefix named '0.3')."""
import warnings

import pytest

from hf_megatron import cli
from hf_megatron.data.builder import parse_data_path
from hf_megatron.parallel import state
from train_cli import base_args, cli_inprocess, make_workspace

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.utils import get_blend_from_list


@pytest.mark.parametrize("items", [
    ["a"], ["a", "b"], ["a", "b", "c"], ["0.3", "a", "0.7", "b"], ["30", "data/x_text_document"],
    ["1e-2", "x", "2", "y", "0.5", "z"], ["1", " padded "],
])
def test_valid_lists_read_as_megatron_core_reads_them(items):
    assert parse_data_path(items) == get_blend_from_list(items)
    if len(items) > 1:  # one quoted argument (or a config file's string) reads the same
        assert parse_data_path([" ".join(items)]) == get_blend_from_list([item.strip() for item in items])


@pytest.mark.parametrize("items, problem", [
    (["0.3", "A", "0.7"], "item 1 '0.3' is a number where a prefix goes (an odd count of items: a weight "
                          "without its prefix?)"),
    (["0.5"], "item 1 '0.5' is a number where a prefix goes (an odd count of items: a weight without its prefix?)"),
    (["A", "0.3", "A", "0.7"], "item 2 '0.3' is a number where a prefix goes (a weight comes before its prefix)"),
    (["0.3", "A", "A", "A"], "item 3 'A' stands in a weight's place and is not a number (item 1 is one)"),
    (["-1", "A"], "item 1 '-1' is a weight and not a positive number"),
    (["0", "A", "1", "A"], "item 1 '0' is a weight and not a positive number"),
    (["nan", "A"], "item 1 'nan' is a weight and not a positive number"),
    (["0.3", "A", "0.7", "0.2"], "item 4 '0.2' is a number where a prefix goes"),
], ids=["odd_with_weights", "weight_alone", "weights_after", "mixed", "negative", "zero", "nan", "number_prefix"])
def test_bad_lists_are_one_line_in_train_and_evaluate(tmp_path, capsys, items, problem):
    root = make_workspace(tmp_path)
    items = [str(root / "corpus_text_document") if item == "A" else item for item in items]
    problem = problem.replace("'A'", repr(str(root / "corpus_text_document")))
    expected = (f"--data-path {' '.join(items)}: expected 'prefix [prefix ...]' or 'w1 prefix1 w2 prefix2 ...' "
                f"(positive blend weights and prefixes alternating); {problem}")
    code, _, err = cli_inprocess(*base_args(root, 2), "--data-path", *items)
    assert code == 2 and err.strip().splitlines() == [f"hf-megatron train: error: {expected}"], err
    capsys.readouterr()
    try:
        code = cli.main(["evaluate", "--hf-model", str(tmp_path / "no_model"), "--data-path", *items])
    finally:
        state.reset()
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [f"hf-megatron evaluate: error: {expected}"], err
