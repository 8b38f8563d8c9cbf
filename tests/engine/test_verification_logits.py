"""Per-decode verification rows out of a step's flattened logits."""

from __future__ import annotations

import torch
from dspark.engine.verify import verification_logits


def test_ragged_rows_repeat_each_decodes_last_row():
    logits = torch.arange(7.0)[:, None].expand(7, 3)  # row r holds r
    # decode 0 verified 2 drafts (rows 0-2), decode 1 none (row 3), decode 2 two (rows 4-6)
    rows = verification_logits(logits, [0, 3, 4], [2, 0, 2], 2)
    assert rows[..., 0].tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 6]]


def test_equally_spaced_decodes_with_a_short_last_one_are_gathered():
    """Two decodes of 3 rows, the last verified nothing: rows 4-5 belong to a prompt chunk."""
    logits = torch.arange(6.0)[:, None].expand(6, 2)
    rows = verification_logits(logits, [0, 3], [2, 0], 2)
    assert rows[..., 0].tolist() == [[0, 1, 2], [3, 3, 3]]


def test_uniform_rows_are_a_view_of_the_logits():
    logits = torch.randn(6, 5)
    rows = verification_logits(logits, [0, 2, 4], [1, 1, 1], 1)
    assert rows.data_ptr() == logits.data_ptr()
    assert torch.equal(rows, logits.view(3, 2, 5))
    plain = verification_logits(logits, list(range(6)), [0] * 6, 0)
    assert torch.equal(plain[:, 0], logits)
