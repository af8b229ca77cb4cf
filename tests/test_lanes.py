"""tests/lanes.py: the tests that need no build shared out over the lanes, whole modules each."""

from __future__ import annotations

import pytest

from tests.lanes import PINNED, RANK, SLOW_WEIGHT, for_lanes, split_by_module


class Item:
    """What the lanes read of a pytest item: its node id, its markers and its module's rank."""

    def __init__(self, nodeid: str, slow: bool = False, pinned: bool = False, rank: int = 0):
        self.nodeid, self.stash = nodeid, {RANK: rank}
        self.markers = {"slow": slow, PINNED: pinned}

    def get_closest_marker(self, name: str):
        return getattr(pytest.mark, name) if self.markers.get(name) else None


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


def test_a_module_with_a_pinned_test_or_a_build_stays_in_this_process():
    items = [
        Item("tests/test_a.py::test_1"),
        Item("tests/test_p.py::test_1"),
        Item("tests/test_b.py::test_1", rank=1),
        Item("tests/test_p.py::test_2", pinned=True),
        Item("tests/test_a.py::test_2"),
    ]
    lane, rest = for_lanes(items)
    assert [item.nodeid for item in lane] == ["tests/test_a.py::test_1", "tests/test_a.py::test_2"]
    assert [item.nodeid for item in rest] == [
        "tests/test_p.py::test_1",  # its module holds a pinned test
        "tests/test_b.py::test_1",
        "tests/test_p.py::test_2",
    ]
