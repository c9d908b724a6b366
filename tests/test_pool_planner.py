"""The pool's planner between sessions (:func:`plan_swaps`, :func:`stale_branches`): pure functions over
hand-built views, exact keys in exact order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvos.policy.planner import SessionView, Swap, plan_swaps, stale_branches


def view(key: str, used: float, blocks: int = 4, *, idle: bool = True, running: bool = False) -> SessionView:
    return SessionView(key, used, blocks, idle=idle, running=running, swappable=True)


def test_over_the_session_count_the_least_recently_used_idle_ones_go() -> None:
    others = [view("a", 3.0), view("b", 1.0), view("c", 2.0, idle=False), view("d", 0.5)]
    assert plan_swaps(others, max_sessions=3, room_blocks=None) == [Swap("d"), Swap("b")]
    assert plan_swaps(others, max_sessions=8, room_blocks=None) == []


def test_a_session_that_cannot_swap_keeps_its_place_in_the_count() -> None:
    """The count takes the oldest idle ones whether or not they can swap: one that cannot is skipped, not
    replaced by the next (as the registry always did)."""
    others = [SessionView("old", 0.0, 4, idle=True, running=False, swappable=False), view("new", 1.0)]
    assert plan_swaps(others, max_sessions=2, room_blocks=None) == []


def test_under_a_cap_parked_sessions_go_until_the_rest_fit() -> None:
    others = [view("a", 1.0, 6), view("b", 2.0, 6), view("c", 3.0, 6, running=True), view("d", 4.0, 6)]
    # parked (not running): a, b, d = 18 blocks; 7 blocks of room: a and b go (6 left), d stays
    assert plan_swaps(others, max_sessions=8, room_blocks=7) == [
        Swap("a", preempted=True, blocks_free=-5),
        Swap("b", preempted=True, blocks_free=1),
    ]
    assert plan_swaps(others, max_sessions=8, room_blocks=18) == []


def test_the_count_goes_first_and_the_cap_counts_what_is_left() -> None:
    others = [view("a", 1.0, 6), view("b", 2.0, 6), view("c", 3.0, 6)]
    assert plan_swaps(others, max_sessions=3, room_blocks=6) == [
        Swap("a"),
        Swap("b", preempted=True, blocks_free=0),
    ]


@given(
    st.lists(
        st.tuples(st.floats(0, 100), st.integers(0, 20), st.booleans(), st.booleans(), st.booleans()),
        max_size=8,
    ),
    st.integers(1, 9),
    st.one_of(st.none(), st.integers(0, 60)),
)
def test_a_plan_swaps_each_session_once_and_leaves_the_rest_within_the_cap(
    rows: list[tuple[float, int, bool, bool, bool]], max_sessions: int, room: int | None
) -> None:
    others = [
        SessionView(f"s{i}", u, b, idle=i_, running=r, swappable=w) for i, (u, b, i_, r, w) in enumerate(rows)
    ]
    plan = plan_swaps(others, max_sessions, room)
    keys = [s.key for s in plan]
    by_key = {s.key: s for s in others}
    assert len(set(keys)) == len(keys)
    assert all(by_key[k].swappable for k in keys)
    assert all(not by_key[s.key].running for s in plan if s.preempted)
    if room is not None:
        left = sum(s.blocks for s in others if not s.running and s.key not in keys)
        movable = sum(s.blocks for s in others if not s.running and s.swappable and s.key not in keys)
        assert left <= room or movable == 0


def test_stale_branches_are_the_least_recently_used_but_the_one_forked_from() -> None:
    used = {"main": 1.0, "b1": 5.0, "b2": 2.0, "b3": 4.0}
    assert stale_branches(used, keep="main", limit=4) == ["b2"]
    assert stale_branches(used, keep="main", limit=3) == ["b2", "b3"]
    assert stale_branches(used, keep="b2", limit=3) == ["main", "b3"]
    assert stale_branches(used, keep="main", limit=5) == []
