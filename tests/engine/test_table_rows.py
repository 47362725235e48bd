"""The graph runners' host block-table buffer rewrites only rows whose table changed, and a
row always ends up holding its table's pages."""

from __future__ import annotations

import numpy as np

from engine_shim.engine.cuda_graphs import TableRows


def test_rows_follow_their_tables_through_growth_replacement_and_padding() -> None:
    buffer = np.full((4, 8), -1, dtype=np.int64)
    rows = TableRows(4)
    a, b = [3, 4], [7]
    rows.write(buffer, [a, b])
    assert buffer[0, :2].tolist() == [3, 4] and buffer[1, 0] == 7
    buffer[0, :2] = 99  # not rewritten while its table is unchanged ...
    rows.write(buffer, [a, b])
    assert buffer[0, :2].tolist() == [99, 99]
    a.append(5)  # ... but once the table grows, the whole row is written again
    rows.write(buffer, [a, b])
    assert buffer[0, :3].tolist() == [3, 4, 5]
    c = [3, 4, 5]  # an equal table in another list (another sequence): written
    buffer[0, :3] = 0
    rows.write(buffer, [c, b])
    assert buffer[0, :3].tolist() == [3, 4, 5]
    rows.write(buffer, [b, c])  # rows swap sequences
    assert buffer[0, 0] == 7 and buffer[1, :3].tolist() == [3, 4, 5]
    buffer[1, 0] = 0  # padding overwrote row 1: forgotten, so written next time
    rows.forget(1, 4)
    rows.write(buffer, [b, c])
    assert buffer[1, :3].tolist() == [3, 4, 5]
    rows.write(buffer, [[6]], first_row=3)
    assert buffer[3, 0] == 6
