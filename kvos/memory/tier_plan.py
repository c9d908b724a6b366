"""Which saved chunks leave a chunk store's tiers: pure functions over a view of its entries.

A :class:`~kvos.memory.store.ChunkStore` holds each chunk in host RAM, on disk, or both (write-through).
When RAM passes its cap, :func:`ram_leavers` names the entries that leave it (the store writes each to disk,
or drops it where it cannot); when disk passes its cap, :func:`disk_leavers` names the files dropped. Both
read a tuple of :class:`Held` records in the store's recency order (least recently used first) and return
keys; they change nothing. The store carries the plans out (:meth:`ChunkStore._keep_within_caps`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Held:
    """One entry of a store as a plan sees it: whether it is in RAM (``ram_bytes``: its encoded K/V bytes
    there) and whether it has a file (``file_bytes``: the file's size)."""

    key: Hashable
    in_ram: bool
    ram_bytes: int
    on_disk: bool
    file_bytes: int


def ram_leavers(held: Sequence[Held], ram_cap: int | None) -> list[Hashable]:
    """The entries to move out of RAM, in order, so that RAM holds at most ``ram_cap`` bytes (None: no cap).

    First every entry too large for RAM on its own (it would push out everything else and still not fit),
    then the least recently used, while what stays is over the cap. Nothing when RAM is within the cap.
    """
    in_ram = [h for h in held if h.in_ram]
    used = sum(h.ram_bytes for h in in_ram)
    if ram_cap is None or used <= ram_cap:
        return []
    oversized = [h for h in in_ram if h.ram_bytes > ram_cap]
    leave = [h.key for h in oversized]
    used -= sum(h.ram_bytes for h in oversized)
    for h in in_ram:
        if used <= ram_cap:
            break
        if h.ram_bytes <= ram_cap:
            leave.append(h.key)
            used -= h.ram_bytes
    return leave


def disk_leavers(held: Sequence[Held], disk_cap: int | None) -> list[Hashable]:
    """The files to drop, least recently used first, so that disk holds at most ``disk_cap`` bytes (None:
    no cap). An entry dropped from disk leaves the store (its RAM copy too, under write-through)."""
    on_disk = [h for h in held if h.on_disk]
    used = sum(h.file_bytes for h in on_disk)
    if disk_cap is None or used <= disk_cap:
        return []
    leave = []
    for h in on_disk:
        if used <= disk_cap:
            break
        leave.append(h.key)
        used -= h.file_bytes
    return leave
