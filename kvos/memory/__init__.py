"""Paged KV memory: block ids (allocator), token -> slot maps (page table), growth policy and the pool."""

from kvos.memory.allocator import BlockAllocator
from kvos.memory.growth import GrowthPolicy
from kvos.memory.page_table import BlockSource, PageTable
from kvos.memory.pool import KVLayout, KVPool

__all__ = ["BlockAllocator", "BlockSource", "GrowthPolicy", "KVLayout", "KVPool", "PageTable"]
