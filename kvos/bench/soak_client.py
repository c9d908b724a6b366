"""The soak's clients: a chat user with a multi-turn conversation of its own, which it keeps and re-sends
whole every turn (as chat clients do), streaming or not, sometimes giving up on a request half-way; the tally
of what every user got back; and the bench's own calls around the load (listings, deletes, checks)."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvos.bench.session import WORDS

CHAT = "/v1/chat/completions"
CANCELLED_MAX_TOKENS = 200  # a request that will be cancelled asks for a long reply (EOS banned)
ERROR_STATUS = {"server_error": 500, "conflict_error": 409, "authentication_error": 401}
SYSTEM = (
    "Keep track of everything the user tells you: numbers, names, places and the order in which they came. "
    "Answer in one or two short sentences, never invent facts, and say so when you do not know something. "
    "The user may paste long notes; summarise them only when asked."
)


@dataclass
class LoadPlan:
    """What every client does: how many turns, how often it streams and cancels, and until when."""

    model: str
    turns: int
    cancel_fraction: float
    deadline: float  # time.monotonic() after which no client starts another turn
    never_end: dict[str, int]  # logit_bias banning EOS, so a request to be cancelled is still running
    stream_fraction: float = 0.5
    timeout_s: float = 600.0  # a request that is not cancelled waits this long for its answer


@dataclass
class Tally:
    """What the clients got back, added to from every client thread."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # HTTP status, or the failure's name
    stream_errors: Counter[str] = field(default_factory=Counter)  # error events inside a 200 stream
    latencies: list[float] = field(default_factory=list)  # seconds of each completed request
    max_active_tokens: int = 0  # the largest usage.kvos.active_tokens in any answer
    reused_tokens: int = 0
    decoded_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, status: str, seconds: float | None = None, usage: dict[str, Any] | None = None) -> None:
        """One request's outcome; ``seconds`` only for one that completed, ``usage`` its usage."""
        extra = (usage or {}).get("kvos", {})
        with self.lock:
            self.requests += 1
            self.statuses[status] += 1
            self.cancelled += status == "cancelled"
            if seconds is not None:
                self.completed += 1
                self.latencies.append(seconds)
            self.max_active_tokens = max(self.max_active_tokens, int(extra.get("active_tokens", 0)))
            self.reused_tokens += int(extra.get("reused_tokens", 0))
            self.decoded_tokens += int(extra.get("decoded_tokens", 0))

    def percentile(self, q: float) -> float | None:
        """The ``q`` quantile of completed requests' seconds (None before any completed)."""
        if len(self.latencies) < 2:
            return self.latencies[0] if self.latencies else None
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[round(q * 100) - 1]


def count_status(statuses: Counter[str], low: int) -> int:
    """Requests answered with an HTTP status in [low, low + 100)."""
    return sum(n for s, n in statuses.items() if s.isdigit() and low <= int(s) < low + 100)


class ChatClient:
    """Client ``index``: its own conversation and API key, seeded choices, and its session: ``session`` is
    sent as ``X-Session-Id``; None lets the server route the conversation by its shared prefix."""

    def __init__(
        self, index: int, url: str, key: str, session: str | None, plan: LoadPlan, tally: Tally, seed: int
    ) -> None:
        self.index, self.plan, self.tally, self.session = index, plan, tally, session
        self.rng = random.Random(seed * 1000 + index)
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"})
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"You are assistant {index}. {SYSTEM}"}
        ]
        self.session_ids: set[str] = set()

    def run(self) -> None:
        """Up to ``plan.turns`` turns, none started after the deadline; an answer the client cannot read
        ends this client (counted as ``client_error:...``)."""
        try:
            for _ in range(self.plan.turns):
                if time.monotonic() >= self.plan.deadline:
                    break
                stream = self.rng.random() < self.plan.stream_fraction
                self.turn(stream, self.rng.random() < self.plan.cancel_fraction, self.message_words())
        except (ValueError, KeyError, TypeError, IndexError) as exc:  # a body that is not what the API says
            self.tally.record(f"client_error:{type(exc).__name__}")
        finally:
            self.http.close()

    def message_words(self) -> int:
        """A user message's length in words: mostly short, some long, a few pasted notes past the budget."""
        roll = self.rng.random()
        if roll < 0.05:
            return self.rng.randint(150, 250)
        return self.rng.randint(40, 120) if roll < 0.2 else self.rng.randint(3, 40)

    def turn(self, stream: bool, cancel: bool, words: int) -> None:
        """Send the conversation with a new user message; keep what came back (a cancelled stream keeps
        its partial reply, as chat UIs do; a request with no answer takes its user message back)."""
        text = " ".join(self.rng.choice(WORDS) for _ in range(words))
        self.messages.append({"role": "user", "content": f"Note {len(self.messages) // 2}: {text}"})
        body: dict[str, Any] = {
            "model": self.plan.model,
            "messages": self.messages,
            "max_tokens": self.rng.randint(4, 40),
            "temperature": 0.8,
            "seed": self.rng.randrange(1 << 30),
        }
        if cancel:
            body.update(max_tokens=CANCELLED_MAX_TOKENS, logit_bias=self.plan.never_end)
        reply = (
            self._stream(body, self.rng.randint(2, 6) if cancel else 0)
            if stream
            else self._plain(body, cancel)
        )
        if reply is None:
            self.messages.pop()
        else:
            self.messages.append({"role": "assistant", "content": reply})

    def _headers(self) -> dict[str, str]:
        return {"X-Session-Id": self.session} if self.session else {}

    def _plain(self, body: dict[str, Any], cancel: bool) -> str | None:
        """A non-streaming request; ``cancel``: the client gives up after a short timeout."""
        timeout = self.rng.uniform(0.1, 0.6) if cancel else self.plan.timeout_s
        began = time.monotonic()
        try:
            r = self.http.post(CHAT, json=body, headers=self._headers(), timeout=timeout)
        except httpx.TimeoutException:
            if cancel:
                self.tally.record("cancelled")
                return None
            self.tally.record("timeout")
            return None
        except httpx.TransportError as exc:
            self.tally.record(type(exc).__name__)
            return None
        self._note_session(r)
        if r.status_code != 200:
            self.tally.record(str(r.status_code))
            return None
        data = r.json()
        self.tally.record("200", time.monotonic() - began, data.get("usage"))
        return str(data["choices"][0]["message"]["content"] or "")

    def _stream(self, body: dict[str, Any], cancel_after: int) -> str | None:
        """A streaming request; ``cancel_after`` > 0: the client closes the stream after that many chunks
        of content (a reply that ends first counts as completed; one that stops without ``[DONE]`` is
        ``incomplete_stream``)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        began, text, chunks, done = time.monotonic(), "", 0, False
        usage: dict[str, Any] | None = None
        try:
            with self.http.stream(
                "POST", CHAT, json=body, headers=self._headers(), timeout=self.plan.timeout_s
            ) as r:
                self._note_session(r)
                if r.status_code != 200:
                    r.read()
                    self.tally.record(str(r.status_code))
                    return None
                for line in r.iter_lines():
                    done = done or line == "data: [DONE]"
                    event = parse_event(line)
                    if event is None:
                        continue
                    if "error" in event:
                        self._stream_error(event["error"])
                        return None
                    usage = event.get("usage") or usage
                    piece = "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
                    text, chunks = text + piece, chunks + bool(piece)
                    if cancel_after and chunks >= cancel_after:
                        self.tally.record("cancelled")
                        return text  # leaving the block closes the connection
        except httpx.TimeoutException:
            self.tally.record("timeout")
            return None
        except httpx.TransportError as exc:
            self.tally.record(type(exc).__name__)
            return None
        if not done:
            self.tally.record("incomplete_stream")
            return None
        self.tally.record("200", time.monotonic() - began, usage)
        return text

    def _stream_error(self, error: dict[str, Any]) -> None:
        """An error event inside a stream that began with 200: counted under the status it stands for."""
        status = ERROR_STATUS.get(str(error.get("type")), 499 if error.get("code") == "cancelled" else 400)
        self.tally.record(str(status))
        with self.tally.lock:
            self.tally.stream_errors[str(error.get("code"))] += 1
        return None

    def _note_session(self, response: httpx.Response) -> None:
        if sid := response.headers.get("x-session-id"):
            self.session_ids.add(sid)


def parse_event(line: str) -> dict[str, Any] | None:
    """A server-sent ``data:`` line's JSON (None for blank lines, comments and ``[DONE]``)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    event: dict[str, Any] = json.loads(line[6:])
    return event


class Calls:
    """The bench's own requests outside the load: models, session listings, deletes, the wedge check;
    every status they get is counted."""

    def __init__(self, url: str, keys: list[str]) -> None:
        self.http = {
            key: httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) for key in keys
        }
        self.statuses: Counter[str] = Counter()

    def call(self, key: str, method: str, path: str, **kw: Any) -> httpx.Response | None:
        """One request; None (counted by the failure's name) when no answer came."""
        try:
            r = self.http[key].request(method, path, timeout=kw.pop("timeout", 120.0), **kw)
        except httpx.HTTPError as exc:
            self.statuses[type(exc).__name__] += 1
            return None
        self.statuses[str(r.status_code)] += 1
        return r

    def sessions(self, key: str) -> list[dict[str, Any]]:
        r = self.call(key, "GET", "/v1/sessions")
        return list(r.json()["data"]) if r is not None and r.status_code == 200 else []

    def close(self) -> None:
        for client in self.http.values():
            client.close()
