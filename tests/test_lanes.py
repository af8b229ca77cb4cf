"""tests/lanes.py: the tests that need no build shared out over the lanes, whole modules each."""

from __future__ import annotations

import pytest

from tests.lanes import SLOW_WEIGHT, split_by_module


class Item:
    """What split_by_module reads of a pytest item: its node id and its slow marker."""

    def __init__(self, nodeid: str, slow: bool = False):
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name: str):
        return pytest.mark.slow if name == "slow" and self.slow else None


def test_whole_modules_go_to_the_lightest_lane_and_keep_their_order():
    items = [
        Item("tests/test_a.py::test_1"),
        Item("tests/test_b.py::test_1", slow=True),
        Item("tests/test_a.py::test_2"),
        Item("tests/test_c.py::test_1", slow=True),
        Item("tests/test_c.py::test_2"),
        Item("tests/test_d.py::test_1"),
    ]
    parts = split_by_module(items, 2)
    ids = [[item.nodeid for item in part] for part in parts]
    # c (SLOW_WEIGHT + 1) to the first lane, b (SLOW_WEIGHT) to the other, a (2) to b's, then
    # d (1) to c's, the lighter by then: 42 each
    assert ids == [
        ["tests/test_c.py::test_1", "tests/test_c.py::test_2", "tests/test_d.py::test_1"],
        ["tests/test_a.py::test_1", "tests/test_b.py::test_1", "tests/test_a.py::test_2"],
    ]
    assert SLOW_WEIGHT > 2  # a's two unit tests weigh less than b's slow one


def test_fewer_modules_than_lanes_leave_no_empty_lane():
    items = [Item("tests/test_a.py::test_1"), Item("tests/test_a.py::test_2")]
    assert [len(part) for part in split_by_module(items, 2)] == [2]
