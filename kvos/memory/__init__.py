"""Paged KV memory: block ids (allocator), token -> slot maps (page table), growth policy, the pool, and the
store that holds the K/V of a session's evicted chunks."""

from kvos.memory.allocator import BlockAllocator
from kvos.memory.growth import GrowthPolicy
from kvos.memory.page_table import BlockSource, PageTable
from kvos.memory.pool import KVLayout, KVPool
from kvos.memory.store import ChunkStore, StoredChunk

__all__ = [
    "BlockAllocator",
    "BlockSource",
    "ChunkStore",
    "GrowthPolicy",
    "KVLayout",
    "KVPool",
    "PageTable",
    "StoredChunk",
]
