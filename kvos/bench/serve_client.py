"""``kvos bench serve``'s clients: one chat user per thread with a multi-turn conversation of its own, re-sent
whole every turn under its own ``X-Session-Id``, every reply streamed and timed token by token on the client.

Each request asks for ``max_tokens`` tokens at temperature 0 with the model's end-of-sequence tokens banned
(``logit_bias`` -100: kvos serve has no ``ignore_eos``), so every reply has ``max_tokens`` tokens unless the
server clips it. It also asks for ``logprobs``: the server then sends one chunk per token, even for a token
whose text is held back (an incomplete UTF-8 character, a random model's id outside its tokenizer), so the
client sees every token arrive. Time to first token is from just before the request is sent to the first
chunk that carries a token; inter-token latency is the gap between consecutive token chunks of one reply.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from kvos.bench.session import WORDS
from kvos.bench.soak_client import CHAT, SYSTEM, parse_event


@dataclass
class Plan:
    """What every client of one run does: the served model id, turns, reply length, EOS ban, deadline."""

    model: str
    turns: int
    max_tokens: int
    never_end: dict[str, int]  # logit_bias banning the model's EOS tokens
    deadline: float  # time.monotonic() after which no client starts another turn
    timeout_s: float = 600.0
    words: tuple[int, int] = (8, 24)  # the range of words in a user message


@dataclass
class Timings:
    """What the clients of one run measured, added to from every client thread."""

    requests: int = 0  # requests sent
    completed: int = 0  # answered 200 with a complete stream
    completion_tokens: int = 0  # usage.completion_tokens of the completed requests
    received_tokens: int = 0  # token chunks the clients received (completed requests)
    ttft_s: list[float] = field(default_factory=list)  # one per completed request
    itl_s: list[float] = field(default_factory=list)  # one per token after the first
    # per reply: its first and last token's stamps, and the tokens after its first
    decode_spans: list[tuple[float, float, int]] = field(default_factory=list)
    max_active_tokens: int = 0  # the largest usage.kvos.active_tokens in any answer
    failures: Counter[str] = field(default_factory=Counter)  # status or error name of failed requests
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, reply: Reply) -> None:
        """One completed request's figures."""
        extra = reply.usage.get("kvos", {})
        with self.lock:
            self.requests += 1
            self.completed += 1
            # a server that sends no usage in its stream: the token chunks the client counted
            self.completion_tokens += int(reply.usage.get("completion_tokens", len(reply.stamps)))
            self.received_tokens += len(reply.stamps)
            if reply.stamps:
                self.ttft_s.append(reply.stamps[0] - reply.sent)
                self.itl_s.extend(b - a for a, b in zip(reply.stamps, reply.stamps[1:], strict=False))
                self.decode_spans.append((reply.stamps[0], reply.stamps[-1], len(reply.stamps) - 1))
            self.max_active_tokens = max(self.max_active_tokens, int(extra.get("active_tokens", 0)))

    def fail(self, what: str) -> None:
        """One request that got no complete answer (``what``: the HTTP status or the failure's name)."""
        with self.lock:
            self.requests += 1
            self.failures[what] += 1


@dataclass
class Reply:
    """One streamed answer: its text, when it was sent, when each token chunk arrived, its usage."""

    sent: float
    text: str = ""
    stamps: list[float] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    status: int | None = None  # the HTTP status, once the server answered


class RequestFailed(Exception):
    """A request that got no complete answer; the message is what :meth:`Timings.fail` counts."""


def percentile_ms(seconds: list[float], q: float) -> float | None:
    """The ``q`` quantile (0-1, linear interpolation) of ``seconds`` in milliseconds; None when empty."""
    return round(float(np.quantile(seconds, q)) * 1000, 2) if seconds else None


def decode_rate(spans: list[tuple[float, float, int]]) -> float:
    """Aggregate decode tok/s: the tokens after each reply's first (its decode phase, from its first token
    to its last), summed over the replies, / the time during which at least one reply was in its decode
    phase (the union of those intervals). Prefill and queueing before a reply's first token are not in it,
    other replies' prefill slices that share steps with its decode are."""
    tokens = sum(n for _, _, n in spans)
    covered, end = 0.0, float("-inf")
    for a, b, _ in sorted(spans):
        if b > end:
            covered += b - max(a, end)
            end = b
    return round(tokens / covered, 2) if covered > 0 else 0.0


class TimedClient:
    """Client ``index`` of a run: session ``session`` (sent as ``X-Session-Id``), its own connection and a
    conversation whose user messages come from ``seed``."""

    def __init__(self, index: int, url: str, session: str, plan: Plan, timings: Timings, seed: int) -> None:
        self.index, self.session, self.plan, self.timings = index, session, plan, timings
        self.rng = random.Random(seed * 1000 + index)
        self.http = httpx.Client(base_url=url, timeout=plan.timeout_s)
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"You are assistant {index}. {SYSTEM}"}
        ]

    def run(self) -> None:
        """Up to ``plan.turns`` turns, none started after the deadline; a failed request ends the client
        (its conversation would no longer be the one the server holds)."""
        try:
            for _ in range(self.plan.turns):
                if time.monotonic() >= self.plan.deadline:
                    break
                self.turn()
        except RequestFailed as exc:
            self.timings.fail(str(exc))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # an answer not as the API says
            self.timings.fail(f"client_error:{type(exc).__name__}")
        finally:
            self.http.close()

    def turn(self) -> None:
        """A new user message, the whole conversation sent, the reply streamed, timed and kept."""
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(*self.plan.words)))
        self.messages.append({"role": "user", "content": f"Note {len(self.messages) // 2}: {words}"})
        reply = self.stream(self.body())
        self.timings.add(reply)
        self.messages.append({"role": "assistant", "content": reply.text})

    def body(self) -> dict[str, Any]:
        """The request: greedy, EOS banned, streamed with usage and one chunk per token (logprobs)."""
        return {
            "model": self.plan.model,
            "messages": self.messages,
            "max_tokens": self.plan.max_tokens,
            "temperature": 0.0,
            "logit_bias": self.plan.never_end,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def stream(self, body: dict[str, Any]) -> Reply:
        """Send ``body``; the reply with the arrival time of every token chunk (RequestFailed when the
        answer is not a complete 200 stream). A kept-alive connection that the server closed just as it
        was reused (no answer at all: ``RemoteProtocolError`` on a plain close, ``ReadError`` or
        ``WriteError`` on a reset) gets the request once more, on a new one."""
        try:
            return self._stream(body)
        except RequestFailed as exc:
            if str(exc) != "stale_connection":
                raise
            return self._stream(body)

    def _stream(self, body: dict[str, Any]) -> Reply:
        headers = {"X-Session-Id": self.session}
        reply, done = Reply(sent=time.perf_counter()), False
        try:
            with self.http.stream("POST", CHAT, json=body, headers=headers) as r:
                reply.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    raise RequestFailed(str(r.status_code))
                for line in r.iter_lines():
                    done = done or line == "data: [DONE]"
                    event = parse_event(line)
                    if event is not None:
                        take_event(reply, event, time.perf_counter())
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            unanswered = reply.status is None
            raise RequestFailed("stale_connection" if unanswered else type(exc).__name__) from exc
        except httpx.HTTPError as exc:
            raise RequestFailed(type(exc).__name__) from exc
        if not done:
            raise RequestFailed("incomplete_stream")
        return reply


def take_event(reply: Reply, event: dict[str, Any], now: float) -> None:
    """Add one server-sent event to ``reply``: its text, a stamp per token it carries (the tokens of its
    ``logprobs``, else one for non-empty text), its usage."""
    if "error" in event:
        raise RequestFailed(f"stream_error:{event['error'].get('code')}")
    reply.usage = event.get("usage") or reply.usage
    for choice in event.get("choices", []):
        piece = choice.get("delta", {}).get("content") or ""
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        reply.text += piece
        reply.stamps.extend([now] * (len(logprobs) or int(bool(piece))))
