"""Paged KV memory: block ids (allocator), token -> slot maps (page table), growth policy, the pool, and the
store that holds evicted blocks."""

from kvos.memory.allocator import BlockAllocator
from kvos.memory.growth import GrowthPolicy
from kvos.memory.page_table import BlockSource, PageTable
from kvos.memory.pool import KVLayout, KVPool
from kvos.memory.store import BlockStore, StoredBlock

__all__ = [
    "BlockAllocator",
    "BlockSource",
    "BlockStore",
    "GrowthPolicy",
    "KVLayout",
    "KVPool",
    "PageTable",
    "StoredBlock",
]
