"""Admission by the pool's capacity: the scheduler starts block-reserving work only while every running
work's reservation fits in the cap (in arrival order); on ``kvos serve --kv-memory`` idle sessions are
swapped out to make room (preemption) and their next request continues exactly as on an uncapped server;
another session's pressure never pages out a session with a request running."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from hf_models import build
from server_harness import MODEL_NAME, running_app

from kvos.builtin import MODEL_DIR
from kvos.engine.engine import Engine
from kvos.engine.scheduler import Scheduler, admissible
from kvos.errors import ConfigError, PoolOutOfMemoryError
from kvos.memory.growth import GrowthPolicy
from kvos.model.loader import load_model
from kvos.policy.budget import Budget
from kvos.server.main import byte_size, check_kv_memory
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(load_model(build("llama", tmp_path_factory.mktemp("llama"))), block_size=4)


@pytest.fixture
def capped(engine: Engine) -> Iterator[Scheduler]:
    sched = Scheduler(engine.model, engine.pool, max_running=4, step_tokens=64, capacity_blocks=10)
    yield sched
    sched.shutdown()


def _decode(engine: Engine, seed: int, log: list[tuple[str, int]], lock: threading.Lock) -> list[int]:
    """A short greedy decode (its forward passes give the turn away, so other work may start meanwhile)."""
    with lock:
        log.append(("start", seed))
    seq = engine.new_sequence()
    ids = torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    logits = engine.extend(seq, ids)[0]
    out = []
    for _ in range(4):
        out.append(int(torch.argmax(logits)))
        logits = engine.decode(seq, out[-1])
    seq.release()
    with lock:
        log.append(("end", seed))
    return out


def _until(engine: Engine, gate: threading.Event) -> bool:
    """Decode until ``gate`` opens (each step gives the turn away, as a running request does)."""
    seq = engine.new_sequence()
    logits = engine.extend(seq, [1, 2, 3])[0]
    while not gate.wait(0.01):
        logits = engine.decode(seq, int(torch.argmax(logits)))
        if seq.num_tokens > 40:
            seq.drop_last(seq.num_tokens - 3)
    seq.release()
    return True


def test_admission_starts_waiting_work_from_the_front_while_it_fits() -> None:
    """The scheduler's admission plan (pure): arrival order, none overtakes, one always runs when nothing
    is reserved, no cap admits all."""
    assert admissible([4, 4, 4], reserved=0, capacity=10) == 2
    assert admissible([4, 1, 1], reserved=6, capacity=10) == 1  # 4 fits (10); the next 1 would not
    assert admissible([8, 1], reserved=4, capacity=10) == 0  # the 1 behind the 8 does not overtake it
    assert admissible([30, 1], reserved=0, capacity=10) == 1  # above the cap alone: it still runs
    assert admissible([30, 30, 30], reserved=99, capacity=None) == 3
    assert admissible([], reserved=0, capacity=10) == 0


def test_reservations_never_pass_the_cap_and_start_in_arrival_order(
    engine: Engine, capped: Scheduler
) -> None:
    """Works reserving 4 of 10 blocks: two run at once (8), never three (12), though ``max_running`` is 4;
    all give the tokens they give alone."""
    log: list[tuple[str, int]] = []
    lock = threading.Lock()
    alone = [_decode(engine, seed, [], lock) for seed in range(6)]  # not on a worker: runs directly
    futures = [capped.admit(4, _decode, engine, seed, log, lock) for seed in range(6)]
    assert [f.result(timeout=120) for f in futures] == alone
    assert capped.stats.max_reserved_blocks == 8
    assert capped.stats.waited_for_blocks >= 4
    assert capped.reserved_blocks == 0
    running, peak = 0, 0
    for kind, _ in log:
        running += 1 if kind == "start" else -1
        peak = max(peak, running)
    assert peak == 2


def test_a_later_smaller_work_does_not_overtake_a_waiting_one(engine: Engine, capped: Scheduler) -> None:
    """6 of 10 blocks held: a work needing 6 waits, and one needing 4 (which would fit) waits behind it
    rather than starve it; both start once the blocks come back."""
    gate = threading.Event()
    hold = capped.admit(6, _until, engine, gate)
    first = capped.admit(6, lambda: "first")
    second = capped.admit(4, lambda: "second")
    assert not gate.wait(0.5)
    assert not first.done() and not second.done()
    assert capped.reserved_blocks == 6
    gate.set()
    assert hold.result(timeout=30)
    assert first.result(timeout=30) == "first" and second.result(timeout=30) == "second"
    assert capped.reserved_blocks == 0


def test_a_reservation_above_the_cap_runs_alone(engine: Engine, capped: Scheduler) -> None:
    lock = threading.Lock()
    log: list[tuple[str, int]] = []
    big = capped.admit(25, _decode, engine, 1, log, lock)
    small = capped.admit(1, _decode, engine, 2, log, lock)
    assert big.result(timeout=120) and small.result(timeout=120)
    assert log == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert capped.stats.max_reserved_blocks == 25


def test_unreserved_work_does_not_wait_for_blocks(engine: Engine, capped: Scheduler) -> None:
    """A delete or a snapshot (``submit``: no blocks) starts while block-reserving work waits for room."""
    gate = threading.Event()
    hold = capped.admit(10, _until, engine, gate)  # holds every block until the gate opens
    waiting = capped.admit(1, lambda: "ran")
    free = capped.submit(lambda: "free")
    assert free.result(timeout=30) == "free"
    assert not waiting.done()
    gate.set()
    assert hold.result(timeout=30) and waiting.result(timeout=30) == "ran"


def test_shutdown_cancels_work_waiting_for_blocks(engine: Engine) -> None:
    sched = Scheduler(engine.model, engine.pool, max_running=2, step_tokens=64, capacity_blocks=4)
    gate = threading.Event()
    hold = sched.admit(4, _until, engine, gate)
    waiting = sched.admit(4, lambda: "never")
    threading.Timer(0.2, gate.set).start()
    sched.shutdown()
    assert hold.result(timeout=30) is True
    assert waiting.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        sched.admit(1, lambda: None)


def test_bad_capacities_are_config_errors(engine: Engine) -> None:
    with pytest.raises(ConfigError, match="capacity_blocks"):
        Scheduler(engine.model, engine.pool, capacity_blocks=0)


# ------------------------------------------------------------------ pressure and running sessions
def test_pressure_never_pages_out_a_session_with_a_request_running() -> None:
    """At the pool's cap the arbiter pages out another idle session's chunk, never a running one's: then
    the requester gives up its own."""
    config = SessionConfig(budget=Budget(max_active_tokens=128), chunk_tokens=16)
    probe = MemoryManager.from_path(MODEL_DIR, config)
    per_block = probe.engine.pool.layout.bytes_per_block
    manager = MemoryManager.from_path(MODEL_DIR, config, growth=GrowthPolicy(max_bytes=64 * per_block))
    pool = manager.engine.pool
    a, b = manager.session("a"), manager.session("b")
    for s in (a, b):
        s.add_message("user", "The ships sailed over the sea to the old harbour in the north. " * 3)
    before_a, before_b = a.pager.active_tokens, b.pager.active_tokens

    def one_more_than_left() -> int:
        return 64 - pool.allocator.num_used + 1

    manager.running.add("a")
    need = one_more_than_left()
    assert manager.arbiter.reserve(b.memory, lambda: need, set())  # b gives up its own chunk
    assert a.pager.active_tokens == before_a and b.pager.active_tokens < before_b
    assert [e["event"] for e in b.memory.journal.events][-2:] == ["evict", "pool_full"]
    manager.running.discard("a")
    need = one_more_than_left()
    assert manager.arbiter.reserve(b.memory, lambda: need, set())  # now a's cheapest chunk goes
    assert a.pager.active_tokens < before_a
    pressure = a.memory.journal.events[-1]
    assert pressure["event"] == "pressure" and pressure["by"] == "b"
    for s in (a, b):
        s.close()


# ------------------------------------------------------------------ kvos serve --kv-memory
def test_kv_memory_sizes_parse() -> None:
    assert byte_size("512M") == 512 << 20
    assert byte_size("1.5GiB") == 3 << 29
    assert byte_size("2GB") == 2 << 30
    assert byte_size("4096") == 4096
    for bad in ("lots", "0", "-1G"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_kv_memory_below_one_request_is_refused_at_start(engine: Engine) -> None:
    config = SessionConfig(budget=Budget(max_active_tokens=512))
    need = config.peak_blocks(engine.pool.layout.block_size) * engine.pool.layout.bytes_per_block
    check_kv_memory(engine, config, need)
    with pytest.raises(SystemExit, match="cannot hold one request"):
        check_kv_memory(engine, config, need - 1)


QUESTIONS = [
    "Tell me about the sea and the ships that sail on it.",
    "What is a block allocator, and why would a cache need one?",
    "Write a short poem about the trees in the old forest.",
    "Why is the sky blue in the day and red at night?",
]
FOLLOW_UP = "Say more about that, please."


def _conversation(url: str, session: str, question: str) -> list[str]:
    """Two turns on one session, the first reply echoed back as a client does."""
    messages = [{"role": "user", "content": question}]
    replies = []
    for turn in range(2):
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 24, "temperature": 0}
        r = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=300)
        assert r.status_code == 200, r.text
        replies.append(str(r.json()["choices"][0]["message"]["content"]))
        if turn == 0:
            messages += [
                {"role": "assistant", "content": replies[-1]},
                {"role": "user", "content": FOLLOW_UP},
            ]
    return replies


def test_server_under_a_cap_preempts_idle_sessions_and_continues_exactly() -> None:
    """``kvos serve --kv-memory`` sized for two requests' reservations, four sessions at once on the
    built-in model with its default budget: at most two requests hold reservations at once, the pool
    never passes the cap, idle sessions are swapped out to make room (preempted) and swapped back in on
    their next turn, and every reply equals the one an uncapped server gives one request at a time."""
    with running_app(MODEL_DIR, "--max-running", "1") as (url, app):
        alone = [_conversation(url, f"s{i}", q) for i, q in enumerate(QUESTIONS)]
        service = app.state.service
        blocks = service.request_blocks()
        block_bytes = service.manager.engine.pool.layout.bytes_per_block
    cap = 2 * blocks * block_bytes
    with running_app(MODEL_DIR, "--kv-memory", str(cap)) as (url, app):
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            together = list(pool.map(lambda iq: _conversation(url, f"s{iq[0]}", iq[1]), enumerate(QUESTIONS)))
        sched, service = app.state.scheduler, app.state.service
        pool_bytes = service.manager.engine.pool.nbytes
        events = [
            e["event"]
            for entry in service.registry.entries.values()
            for e in entry.session.memory.journal.events
        ]
    assert together == alone
    assert sched.capacity_blocks == 2 * blocks
    assert sched.stats.max_reserved_blocks == 2 * blocks  # two at once, never more
    assert sched.stats.waited_for_blocks >= 1
    assert pool_bytes <= cap
    assert "preempt" in events and "swap_in" in events


def test_a_full_pool_is_answered_503_kv_memory_full() -> None:
    """When a request still finds the pool full (its reservation is an estimate), the client gets an
    OpenAI-style 503 ``kv_memory_full``, streamed or not, and the session is free again."""
    with running_app(MODEL_DIR, "--kv-memory", "64M") as (url, app):
        service = app.state.service
        real = service.run

        def full(*args: object, **kwargs: object) -> object:
            yield from real(*args, **kwargs)
            raise PoolOutOfMemoryError(needed_bytes=2 << 26, max_bytes=1 << 26, pool_bytes=1 << 26)

        service.run = full
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": "f"}, timeout=120)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "kv_memory_full"
        assert r.json()["error"]["type"] == "server_error"
        streamed = httpx.post(
            f"{url}/chat/completions",
            json={**body, "stream": True},
            headers={"X-Session-Id": "f"},
            timeout=120,
        )
        assert '"code": "kv_memory_full"' in streamed.text
        assert not any(e.busy for e in service.registry.entries.values())
