"""The scheduler: every session's work runs under it, and their forward passes run batched.

Work (a request's turn, a delete, a snapshot) is submitted like to an executor and runs on a worker
thread of its own, but only one worker runs at a time: the one holding the *turn*. A worker gives the turn
up (to the next ready worker, or back to the scheduler) when its work ends or when it needs a forward
pass: the scheduler installs itself as the worker's pass runner (:mod:`kvos.engine.passes`), so
:meth:`Engine.extend` hands the pass to it instead of running the model, with no knowledge of the
scheduler and no second code path. Once every admitted worker is waiting for a forward pass, the
scheduler runs one *step*: a single forward pass over the decode tokens of every waiting sequence plus
the prefill slices that fit in ``step_tokens`` (continuous batching with chunked prefill: a prefill
*slice* is what is usually called a prefill chunk; here a chunk is a piece of a session's history), then
hands each worker its output and its turn back, oldest first (each passing it on to the next).

So the policy code of a session (paging, scoring, sampling) never runs concurrently with another session's
or with a forward pass, exactly as on a single engine thread, while eight sessions' decode steps share one
read of the weights. At most ``max_running`` works are admitted at once; the rest wait in arrival order.
Work that runs under the scheduler must not block on another worker (it would hold the turn while it
waits): waits for a busy session happen before the work is submitted.

**Admission by the pool's capacity.** Work submitted with :meth:`admit` reserves a number of pool blocks
(its session's peak, as the server estimates it) for as long as it runs. With a ``capacity_blocks`` (the
pool's cap), such work is started only while the reservations of everything running plus its own fit in
the cap, in arrival order: a request the pool cannot hold waits instead of running into the cap. One work
always runs when nothing else holds a reservation, so a reservation above the cap still makes progress.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvos.engine import logit_stats
from kvos.engine.passes import runs_passes
from kvos.engine.step_costs import StepCosts
from kvos.engine.threads import pin_to_first_cpu, set_thread_count
from kvos.errors import ConfigError
from kvos.model.attention import BatchItem
from kvos.model.transformer import NO_STORE, KVStore, Transformer

T = TypeVar("T")
_log = logging.getLogger("kvos.scheduler")


def admissible(waiting: Sequence[int], reserved: int, capacity: int | None) -> int:
    """How many of the waiting works start now: ``waiting`` their block reservations in arrival order,
    ``reserved`` the blocks the running work holds, ``capacity`` the pool's cap in blocks (None: none).
    From the front while the reservations fit the cap, so none overtakes an earlier one; a work starts
    whatever its size when nothing is reserved (a reservation above the cap still makes progress)."""
    count = 0
    for blocks in waiting:
        if not (capacity is None or reserved == 0 or reserved + blocks <= capacity):
            break
        reserved += blocks
        count += 1
    return count


class _Baton:
    """A semaphore that holds at most one release: a lock taken at creation, released by whoever hands
    the turn over and taken by whoever waits for it (a lock's ``acquire`` and ``release`` are C, where a
    ``threading.Semaphore``'s run a condition in Python: 3 us less a hand-over, ~9 hand-overs a step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def acquire(self) -> bool:
        return self._lock.acquire()


class _Worker:
    """One admitted work's thread: it runs only while the scheduler has handed it the turn."""

    def __init__(self) -> None:
        self.go = _Baton()
        self.pending = 0  # its asks not yet run: it gets the turn back when none is left


@dataclass
class _Ask:
    """A worker's forward pass, waiting for the next step."""

    worker: _Worker
    item: BatchItem
    standalone: bool = False  # a pass over tokens of no sequence (an embedding): it touches no pool
    result: torch.Tensor | None = None
    error: BaseException | None = None
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = int(self.item.token_ids.shape[0])


@dataclass
class StepStats:
    """What the scheduler has run so far (its tests read it: how many asks shared a step)."""

    steps: int = 0
    items: int = 0
    tokens: int = 0
    max_items: int = 0
    max_reserved_blocks: int = 0  # the most pool blocks reserved by running work at once
    waited_for_blocks: int = 0  # works that waited for pool blocks at admission
    forward_s: float = 0.0  # seconds of the steps' forward passes
    turns_s: float = 0.0  # seconds of the workers' turns between steps (sampling, streaming, bookkeeping)

    def add(self, asks: list[_Ask]) -> None:
        self.steps += 1
        self.items += len(asks)
        self.tokens += sum(a.tokens for a in asks)
        self.max_items = max(self.max_items, len(asks))


class Scheduler(Executor):
    """Runs submitted work one turn at a time and batches its forward passes (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        kv: KVStore,
        max_running: int = 8,
        step_tokens: int = 2048,
        capacity_blocks: int | None = None,
        stall: float | None = 3.0,
        threads: int | None = None,
        pin_workers: bool = True,
    ) -> None:
        """``capacity_blocks``: the pool's cap in blocks, which :meth:`admit` keeps reservations within
        (None: no cap, reservations are only counted). ``stall``: a step that carries prefill beside
        running decodes lasts at most about this many decode steps (its prefill is cut to fit, from the
        step costs measured so far: :class:`StepCosts`); None: prefill fills ``step_tokens``. ``threads``:
        torch's intra-op threads for the forward passes (default: the constructing thread's count), set
        on the scheduler's thread before every step (:mod:`kvos.engine.threads`). ``pin_workers``: the
        worker threads share one CPU (:func:`pin_to_first_cpu`: they run one at a time)."""
        if max_running < 1 or step_tokens <= max_running:
            raise ConfigError(
                f"max_running must be at least 1 and step_tokens above it, got {max_running} and "
                f"{step_tokens}"
            )
        if stall is not None and stall <= 1.0:
            raise ConfigError(f"stall must be above 1 (a multiple of a decode step) or None, got {stall}")
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ConfigError(f"capacity_blocks must be at least 1 or None, got {capacity_blocks}")
        self.model, self.kv = model, kv
        self.max_running, self.step_tokens = max_running, step_tokens
        self.capacity_blocks = capacity_blocks
        self.reserved_blocks = 0  # blocks reserved by admitted work that has not ended
        self._waiting: deque[tuple[int, Callable[[], None], Future[Any]]] = deque()  # waiting for blocks
        self.stall = stall
        self.costs = StepCosts()
        self._decoders: frozenset[_Worker] = frozenset()  # whose decodes the last step ran (likely the next)
        self.stats = StepStats()
        self._mu = threading.Lock()
        self._ready: deque[_Worker] = deque()  # admitted workers waiting for the turn
        self._asks: list[_Ask] = []  # forward passes waiting for the next step
        self._back = _Baton()  # the turn came back to the scheduler
        self._work = threading.Event()  # something to do (a worker is ready, or stop)
        self._stopping = False  # the loop ends once no work is left
        self._closed = False  # no new work is taken
        self._local = threading.local()
        self._between: list[Callable[[], None]] = []  # run each time the turns between two steps end
        self._idle: list[Callable[[], None]] = []  # run each time the loop runs out of work
        self._running = 0  # admitted works that have entered and not yet ended
        self._pool = ThreadPoolExecutor(
            max_workers=max_running,
            thread_name_prefix="kvos-worker",
            initializer=pin_to_first_cpu if pin_workers else None,
        )
        self.threads = threads if threads is not None else torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="kvos-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ executor
    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` under the scheduler once admitted; its future holds the result."""
        return self.admit(0, fn, *args, **kwargs)

    def admit(self, blocks: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Like :meth:`submit`, for work that may hold up to ``blocks`` pool blocks while it runs: it starts
        once the reservations of the running work and its own fit in ``capacity_blocks`` (in arrival order
        among such work), and gives its blocks back when it ends."""
        if self._closed:
            raise RuntimeError("the scheduler is shut down")
        if blocks < 0:
            raise ConfigError(f"a work reserves a non-negative number of blocks, got {blocks}")
        future: Future[T] = Future()

        def run() -> None:
            # the blocks and the turn go back before the future resolves: whoever waits on it sees them free
            try:
                if not future.set_running_or_notify_cancel():
                    return
                self._enter()
                try:
                    with runs_passes(self):  # this work's forward passes join the steps
                        result = fn(*args, **kwargs)
                except BaseException as exc:
                    error: BaseException | None = exc
                else:
                    error = None
                finally:
                    self._local.worker = None
                    with self._mu:
                        self._running -= 1
                    self._pass_turn()  # for good
            finally:
                if blocks:
                    self._unreserve(blocks)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        if blocks == 0:
            self._pool.submit(run)
            return future
        with self._mu:
            self._waiting.append((blocks, run, future))
            if len(self._waiting) > 1 or not self._fits(blocks):
                self.stats.waited_for_blocks += 1
            self._start_fitting()
        return future

    def _fits(self, blocks: int) -> bool:
        """Whether ``blocks`` more fit beside the reservations now (under ``_mu``)."""
        return admissible([blocks], self.reserved_blocks, self.capacity_blocks) == 1

    def _start_fitting(self) -> None:
        """Start the waiting work :func:`admissible` admits (under ``_mu``)."""
        if self._closed:
            return
        waiting = [blocks for blocks, _, _ in self._waiting]
        for _ in range(admissible(waiting, self.reserved_blocks, self.capacity_blocks)):
            blocks, run, _ = self._waiting.popleft()
            self.reserved_blocks += blocks
            self.stats.max_reserved_blocks = max(self.stats.max_reserved_blocks, self.reserved_blocks)
            self._pool.submit(run)

    def _unreserve(self, blocks: int) -> None:
        with self._mu:
            self.reserved_blocks -= blocks
            self._start_fitting()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._mu:  # work still waiting for blocks never starts
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
        for _, _, future in waiting:
            future.cancel()
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)
        self._stopping = True
        self._work.set()
        if wait:
            self._thread.join()

    @property
    def slice_tokens(self) -> int:
        """The most tokens of one prefill slice: what fits in a step beside every running decode token
        (so no slice starves), and while other sessions decode, what keeps a step within ``stall`` decode
        steps. A worker's own decoding does not count: a session that prefills right after its reply (the
        canonical re-sync) would otherwise wait for its own stall budget with no one to protect."""
        most = self.step_tokens - self.max_running
        others = self._decoders - {getattr(self._local, "worker", None)}
        budget = self.costs.prefill_budget(self.stall) if self.stall and others else None
        return most if budget is None else min(most, budget)

    # ------------------------------------------------------------------ workers
    def forward(self, item: BatchItem, standalone: bool = False) -> torch.Tensor:
        """On a worker: give the turn back, have ``item`` run in the next step, and return its output once
        the turn comes back (what :meth:`Transformer.forward` would return for it alone). ``standalone``:
        a fresh pass that reads and writes no pool (an embedding's)."""
        return self.forward_many([item], standalone)[0]

    def forward_many(self, items: list[BatchItem], standalone: bool = False) -> list[torch.Tensor]:
        """:meth:`forward` for several passes of one worker (its scratch sequences', say): they join the
        next step together, or the next few where the step's limits cut them, and the turn comes back
        once all have run. Raises the first pass's error, if any failed."""
        if not items:
            return []
        worker: _Worker = self._local.worker
        asks = [_Ask(worker, item, standalone) for item in items]
        with self._mu:
            worker.pending = len(asks)
            self._asks.extend(asks)
        self._pass_turn()
        worker.go.acquire()
        results = []
        for ask in asks:
            if ask.error is not None:
                raise ask.error
            assert ask.result is not None
            results.append(ask.result)
        return results

    def _pass_turn(self) -> None:
        """On the worker holding the turn: hand it straight to the next ready worker, else back to the
        loop (which then runs a step). One thread wakes per turn, not two (the loop's and the next
        worker's): at 8 sessions a wake cost ~0.1 ms of each session's turn between steps."""
        with self._mu:
            following = self._ready.popleft() if self._ready else None
        if following is not None:
            following.go.release()
        else:
            self._back.release()

    def _enter(self) -> None:
        """Join the ready queue and wait for the turn."""
        worker = _Worker()
        self._local.worker = worker
        with self._mu:
            self._running += 1
            self._ready.append(worker)
            self._work.set()
        worker.go.acquire()

    def after_turns(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the scheduler's thread each time the workers' turns between two steps have all
        ended (before the next step, or before waiting for work): where what the turns produced for other
        threads is handed over at once (:class:`kvos.server.lifecycle.Outbox`)."""
        self._between.append(fn)

    def when_idle(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the scheduler's thread each time it runs out of work (no turn to hand over, no
        step to run), before it waits: where work goes that would hold up every running stream, such as
        a full garbage collection (:meth:`kvos.server.registry.SessionRegistry.reclaim_if_due`)."""
        self._idle.append(fn)

    def others_running(self) -> bool:
        """Whether admitted work besides the caller's own is running (holding the turn, waiting for it, or
        waiting for a step): on a worker, whether what it does now would hold up other sessions."""
        own = 1 if getattr(self._local, "worker", None) is not None else 0
        with self._mu:
            return self._running > own

    def _turns_ended(self) -> None:
        self._call(self._between, "after the turns")

    def _call(self, hooks: list[Callable[[], None]], when: str) -> None:
        for fn in hooks:
            try:
                fn()
            except Exception:  # a hook's failure must not stop the loop
                _log.exception("a hook %s failed", when)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        """Hand the turn to the first ready worker (each passes it on to the next, oldest first, and the
        last back here: :meth:`_pass_turn`); when none is ready, run one step."""
        while True:
            with self._mu:
                worker = self._ready.popleft() if self._ready else None
                step = self._take_step() if worker is None else []
                if worker is None and not step:
                    if self._stopping:
                        return
                    self._work.clear()
            if worker is not None:
                began = time.perf_counter()
                worker.go.release()
                self._back.acquire()
                self._turns_ended()
                self.stats.turns_s += time.perf_counter() - began
            elif step:
                self._run(step)
                with self._mu:
                    for ask in step:
                        ask.worker.pending -= 1
                        if ask.worker.pending == 0:
                            self._ready.append(ask.worker)
            else:
                self._call(self._idle, "when idle")
                self._work.wait()

    def _take_step(self) -> list[_Ask]:
        """The asks of the next step (called under ``_mu``): every decode token, then prefill slices in
        arrival order while they fit in ``step_tokens`` and, beside decodes, in the ``stall`` budget. The
        oldest slice always goes (the engine cuts slices to :attr:`slice_tokens`), so no prefill waits
        behind running decodes."""
        if not self._asks:
            return []
        taken = [a for a in self._asks if a.tokens == 1]
        limit = self.step_tokens
        budget = self.costs.prefill_budget(self.stall) if self.stall and taken else None
        if budget is not None:
            limit = min(limit, len(taken) + budget)
        used, oldest = len(taken), True
        for ask in self._asks:
            if ask.tokens > 1 and (oldest or used + ask.tokens <= limit):
                taken.append(ask)
                used += ask.tokens
                oldest = False
        chosen = {id(a) for a in taken}
        self._asks = [a for a in self._asks if id(a) not in chosen]
        return taken

    def _run(self, step: list[_Ask]) -> None:
        """One forward pass over the step's asks that extend sequences, one over its standalone ones; if
        a pass fails, each of its asks runs alone so that only the ones that fail on their own get the
        error. The step's duration feeds :attr:`costs`."""
        self.stats.add(step)
        set_thread_count(self.threads)  # this thread's own, whatever the process-wide default became
        began = time.perf_counter()
        for asks, kv in (
            ([a for a in step if not a.standalone], self.kv),
            ([a for a in step if a.standalone], NO_STORE),
        ):
            if asks:
                self._pass(asks, kv)
        decodes = sum(1 for a in step if a.tokens == 1)
        seconds = time.perf_counter() - began
        self.stats.forward_s += seconds
        self.costs.observe(decodes, sum(a.tokens for a in step if a.tokens > 1), seconds)
        self._decoders = frozenset(a.worker for a in step if a.tokens == 1)

    def _pass(self, asks: list[_Ask], kv: KVStore) -> None:
        try:
            outputs = self.model.forward_batch([a.item for a in asks], kv)
        except BaseException as exc:
            if len(asks) == 1:
                asks[0].error = exc
                return
            _log.warning("a batched step failed (%s); running its %d asks one by one", exc, len(asks))
            for ask in asks:
                try:
                    ask.result = self.model.forward_batch([ask.item], kv)[0]
                except BaseException as one:
                    ask.error = one
            return
        logit_stats.attach([a.item for a in asks], outputs)  # on the step's threads, the logits in cache
        for ask, out in zip(asks, outputs, strict=True):
            ask.result = out
