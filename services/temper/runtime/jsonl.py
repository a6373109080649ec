"""Reading JSON Lines: one way for every reader of a user's ``.jsonl`` file (datasets, tests folders, reward-model
records, dataset exports), so blank lines, row and line numbers and a line that is not JSON mean the same in all.
Each caller words its own error (the field or flag it names) through ``fail``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def jsonl_rows(lines: Iterable[str], fail: Callable[[int, int, ValueError], Exception]
               ) -> Iterator[tuple[int, int, Any]]:
    """``(row, line, value)`` of each non-blank line (row counts non-blank lines, line counts all, both from 1);
    a line that is not JSON raises ``fail(row, line, error)``."""
    row = 0
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row += 1
        try:
            value = json.loads(line)
        except ValueError as e:
            raise fail(row, line_no, e) from None
        yield row, line_no, value
