"""``kvos serve --state-dir``: real server processes on the built-in model (budget 256, so chunks are evicted
and saved, as in a long session), killed with SIGKILL or stopped with SIGTERM and started again on the same
directory. A client that re-sends its conversation gets the cache back from disk: the reused tokens are what
the snapshot and its chunk files cover, and the next reply is the one a server that never stopped gives.
A damaged file is detected and recomputed, never served."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvos.builtin import MODEL_DIR
from kvos.model.tokenizer import load_tokenizer
from kvos.server.layout import MANIFEST, read_manifest
from kvos.session import snapshot

TOKENIZER = load_tokenizer(MODEL_DIR)
MODEL = "kvos-test"
TURNS = 4


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def ask(self, sid: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{self.url}/chat/completions", json=body, headers={"X-Session-Id": sid}, timeout=120)
        r.raise_for_status()
        return dict(r.json())

    def session(self, sid: str) -> dict[str, Any]:
        rows = httpx.get(f"{self.url}/sessions", timeout=30).json()["data"]
        return dict(next(s for s in rows if s["id"] == sid))


@contextmanager
def serve(state: Path, tmp: Path, interval: float = 0) -> Iterator[Server]:
    """``python -m kvos serve`` on a free loopback port; killed (by its pid) if the test leaves it running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp / f"server-{port}.log"
    argv = ["--port", str(port), "--budget", "256", "--served-model-name", MODEL]
    argv += ["--state-dir", str(state), "--state-interval", str(interval)]
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "kvos", "serve", *argv], stdout=out, stderr=out)
    server = Server(process, f"http://127.0.0.1:{port}/v1", log)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(f"{server.url[:-3]}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        yield server
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def stop(server: Server, how: signal.Signals) -> int | None:
    """Send ``how`` and wait for the end (uvicorn ends a graceful shutdown by re-raising SIGTERM, so both
    end by their signal); the sessions the shutdown wrote (None: no shutdown ran)."""
    os.kill(server.process.pid, how)
    assert server.process.wait(timeout=60) == -how
    written = re.search(r"shutdown: (\d+) sessions written", server.log.read_text())
    return None if written is None else int(written[1])


def user(turn: int) -> dict[str, str]:
    return {
        "role": "user",
        "content": f"Note {turn}: the crate numbered {turn * 37 % 101} holds {turn % 9 + 2} lanterns, and "
        f"the ferry to island {turn % 7} leaves at {8 + turn % 10} o'clock; please remember it.",
    }


@dataclass
class Conversation:
    messages: list[dict[str, str]] = field(
        default_factory=lambda: [{"role": "system", "content": "Be brief."}]
    )
    replies: list[str] = field(default_factory=list)

    def turn(self, server: Server, sid: str, turn: int) -> dict[str, Any]:
        """Send the conversation plus the user message of ``turn``; keep the reply."""
        body = server.ask(sid, [*self.messages, user(turn)])
        self.messages += [
            user(turn),
            {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
        ]
        self.replies.append(body["choices"][0]["message"]["content"])
        return body


def tail_tokens(turn: int) -> int:
    """Tokens of a new user message plus the generation prompt (the built-in ChatML template)."""
    content = user(turn)["content"]
    return len(TOKENIZER.encode(f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"))


def stored(state: Path, sid: str) -> tuple[dict[str, Any], snapshot.SessionSnapshot, Path]:
    """The manifest of session ``sid``, its main branch's snapshot and that branch's directory."""
    for path in state.glob(f"*/local/*/{MANIFEST}"):
        manifest = read_manifest(path)
        if manifest["session_id"] == sid:
            branch = manifest["branches"][0]
            directory = path.parent / branch["dir"]
            return manifest, snapshot.load(directory / branch["snapshot"]), directory
    raise AssertionError(f"no stored session {sid}")


def covered(snap: snapshot.SessionSnapshot) -> int:
    """Tokens of the chunks whose K/V the snapshot keeps in a chunk file (resident or saved)."""
    files = snap.files
    return sum(len(c["token_ids"]) for c in snap.header["chunks"] if c["chunk_id"] in files)


def kvos_usage(body: dict[str, Any]) -> dict[str, Any]:
    return dict(body["usage"]["kvos"])


def damage(directory: Path, snap: snapshot.SessionSnapshot) -> tuple[str, str]:
    """Flip one payload byte of the last resident chunk's file and truncate the first saved chunk's file;
    returns the two file names."""
    resident = {cid for cid, _ in snap.header["cache"]}
    flipped = snap.files[snap.header["cache"][-1][0]]
    truncated = snap.files[min(cid for cid in snap.files if cid not in resident)]
    data = bytearray((directory / flipped).read_bytes())
    data[-3] ^= 0x01
    (directory / flipped).write_bytes(bytes(data))
    cut = directory / truncated
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    return flipped, truncated


def test_sessions_survive_kill_and_shutdown(tmp_path: Path) -> None:
    state, talk = tmp_path / "state", Conversation()
    with serve(state, tmp_path, interval=0.5) as a:  # written twice a second while changed and idle
        for turn in range(TURNS):
            talk.turn(a, "s", turn)
        live = a.session("s")
        assert live["evictions"] > 0 and live["chunks"]["saved"] > 0
        deadline = time.monotonic() + 60
        while not any(state.glob(f"*/local/*/{MANIFEST}")) or (
            stored(state, "s")[1].history_tokens != live["history_tokens"]
        ):
            assert time.monotonic() < deadline, "the session was never written"
            time.sleep(0.1)
        assert stop(a, signal.SIGKILL) is None
    _, snap, _ = stored(state, "s")
    assert covered(snap) == snap.history_tokens == live["history_tokens"]

    with serve(state, tmp_path) as b:  # after kill -9: the cache comes back from disk, exactly
        body = talk.turn(b, "s", TURNS)
        u = kvos_usage(body)
        assert u["reused_tokens"] == covered(snap)  # nothing that was on disk is prefilled again
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == u["reused_tokens"]
        assert body["usage"]["prompt_tokens"] - u["reused_tokens"] == tail_tokens(TURNS)
        reference = Conversation()  # a session that never stopped, on the same server
        for turn in range(TURNS + 1):
            reference.turn(b, "ref", turn)
        assert reference.replies == talk.replies
        talk.turn(b, "s", TURNS + 1)
        reference.turn(b, "ref", TURNS + 1)
        assert reference.replies == talk.replies
        history = b.session("s")["history_tokens"]
        assert stop(b, signal.SIGTERM) == 2  # a clean shutdown writes every changed session: s and ref
    manifest, snap, directory = stored(state, "s")
    assert snap.history_tokens == history == stored(state, "ref")[1].history_tokens
    assert manifest["served"] == TURNS + 2
    assert {p.name for p in directory.iterdir()} == {
        *snap.files.values(),
        manifest["branches"][0]["snapshot"],
    }

    flipped, truncated = damage(directory, snap)  # s's files only; ref's stay whole
    with serve(state, tmp_path) as d:
        bodies = {sid: d.ask(sid, [*talk.messages, user(TURNS + 2)]) for sid in ("ref", "s")}
    used = {sid: kvos_usage(body) for sid, body in bodies.items()}
    assert used["ref"]["reused_tokens"] == used["s"]["reused_tokens"] == history  # the whole cache
    assert used["s"]["recoveries"] == used["ref"]["recoveries"] + 1  # the flipped chunk, recomputed
    log = d.log.read_text()
    assert "checksum mismatch" in log and flipped in log and truncated in log
    replies = {sid: body["choices"][0]["message"]["content"] for sid, body in bodies.items()}
    assert replies["s"] == replies["ref"]  # recomputed, not served: the same reply
