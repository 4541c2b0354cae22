"""The csrc AdamW's pointer tables (kernels/adamw.py `_table`), on CPU: kept by content, a few at most."""
import torch

from hf_megatron.kernels import adamw


def test_tables_are_reused_by_content_and_bounded():
    device = torch.device("cpu")
    rows = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    first = adamw._table(rows, device)
    assert torch.equal(first, torch.tensor(rows))
    assert adamw._table([list(r) for r in rows], device) is first  # equal rows: the same tensor, no copy
    other = adamw._table([[0] * 7], device)
    assert other is not first and torch.equal(other, torch.zeros(1, 7, dtype=torch.int64))
    for n in range(2 * adamw._TABLES_KEPT):
        adamw._table([[n] * 7], device)
    assert len(adamw._TABLES) <= adamw._TABLES_KEPT
    assert torch.equal(adamw._table(rows, device), torch.tensor(rows))  # evicted, then rebuilt right
