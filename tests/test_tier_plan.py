"""The chunk store's tier plans (:mod:`kvos.memory.tier_plan`): pure functions over hand-built views, exact
keys in exact order, and properties over random stores."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import given
from hypothesis import strategies as st

from kvos.memory.tier_plan import Held, disk_leavers, ram_leavers


def ram(key: str, nbytes: int, file_bytes: int = 0) -> Held:
    return Held(key, True, nbytes, file_bytes > 0, file_bytes)


def disk(key: str, file_bytes: int) -> Held:
    return Held(key, False, 0, True, file_bytes)


def test_within_the_caps_nothing_leaves() -> None:
    held = [ram("a", 10), disk("b", 50), ram("c", 20)]
    assert ram_leavers(held, 30) == [] and ram_leavers(held, None) == []
    assert disk_leavers(held, 50) == [] and disk_leavers(held, None) == []


def test_ram_keeps_the_most_recent_entries_within_its_cap() -> None:
    held = [ram("a", 10), disk("b", 50), ram("c", 20), ram("d", 15), ram("e", 5)]
    assert ram_leavers(held, 40) == ram_leavers(held, 49) == ["a"]  # 50 in RAM; 40 once a leaves
    assert ram_leavers(held, 30) == ["a", "c"]
    assert ram_leavers(held, 0) == ["a", "c", "d", "e"]


def test_an_entry_too_large_for_ram_leaves_first_and_alone() -> None:
    """An entry larger than the cap leaves before any other (pushing out the rest would not make it fit)."""
    held = [ram("a", 10), ram("b", 20), ram("huge", 100)]
    assert ram_leavers(held, 30) == ["huge"]
    assert ram_leavers(held, 25) == ["huge", "a"]


def test_zero_byte_entries_in_ram_leave_in_their_turn() -> None:
    """A chunk of no tokens holds no bytes but is in RAM: the least recently used leave in order, so RAM
    keeps a suffix of the recency order (what the store's own model test checks)."""
    held = [ram("empty", 0), ram("a", 10), ram("b", 30)]
    assert ram_leavers(held, 30) == ["empty", "a"]


def test_disk_drops_the_least_recently_used_files() -> None:
    held = [disk("a", 100), ram("r", 5, file_bytes=40), disk("b", 100), disk("c", 100)]
    assert disk_leavers(held, 250) == ["a"]
    assert disk_leavers(held, 200) == ["a", "r"]  # a written-through RAM entry's file counts and goes too
    assert disk_leavers(held, 0) == ["a", "r", "b", "c"]


def by_key(held: list[Held]) -> dict[Hashable, Held]:
    return {h.key: h for h in held}


entries = st.lists(
    st.tuples(st.booleans(), st.integers(0, 64), st.booleans(), st.integers(1, 64)), max_size=20
).map(
    lambda rows: [
        Held(i, in_ram, nbytes if in_ram else 0, on_disk, size if on_disk else 0)
        for i, (in_ram, nbytes, on_disk, size) in enumerate(rows)
    ]
)


@given(entries, st.integers(0, 200))
def test_ram_plans_leave_ram_within_the_cap_and_keep_the_most_recent_that_fit(
    held: list[Held], cap: int
) -> None:
    leave = ram_leavers(held, cap)
    assert len(set(leave)) == len(leave) and set(leave) <= {h.key for h in held if h.in_ram}
    stays = [h for h in held if h.in_ram and h.key not in leave]
    assert sum(h.ram_bytes for h in stays) <= cap
    assert all(h.ram_bytes <= cap for h in stays)
    fitting = [h.key for h in held if h.in_ram and h.ram_bytes <= cap]
    left_of_fitting = [k for k in leave if k in fitting]
    assert left_of_fitting == fitting[: len(left_of_fitting)]  # the oldest of those that fit alone
    if left_of_fitting:  # and no more: keeping the newest of them would break the cap
        assert sum(h.ram_bytes for h in stays) + by_key(held)[left_of_fitting[-1]].ram_bytes > cap


@given(entries, st.integers(0, 400))
def test_disk_plans_drop_the_oldest_files_and_no_more(held: list[Held], cap: int) -> None:
    leave = disk_leavers(held, cap)
    files = [h.key for h in held if h.on_disk]
    assert leave == files[: len(leave)]
    left = sum(h.file_bytes for h in held if h.on_disk and h.key not in leave)
    assert left <= cap
    if leave:
        assert left + by_key(held)[leave[-1]].file_bytes > cap
