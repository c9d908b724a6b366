"""``kvos bench serve`` at CI scale: the built-in model behind a real ``kvos serve`` process, 1 and 2 clients
of 2 turns each, 4 tokens a reply."""

from __future__ import annotations

import argparse
import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from kvos.bench import serve
from kvos.bench.serve_client import decode_rate
from kvos.errors import ConfigError

ROW_FIELDS = (
    "model",
    "label",
    "clients",
    "aggregate_tok_s",
    "decode_tok_s",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "itl_p50_ms",
    "itl_p95_ms",
    "max_active_tokens",
    "budget",
    "requests",
    "completion_tokens",
    "wall_s",
)


def serve_args(*argv: str) -> argparse.Namespace:
    """``kvos bench serve ARGV...`` parsed as the CLI parses it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_bench_at_ci_scale(tmp_path: Path) -> None:
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = ["--models", "builtin", "--clients", "1,2", "--turns", "2", "--max-tokens", "4", "--label", "ci"]
    result = serve.run(serve_args(*argv, "--json", str(out), "--plot", str(png), "--max-seconds", "900"))
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "serve" and result["model"] == "builtin"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = result["rows"]
    assert [r["clients"] for r in rows] == [1, 2]
    for row in rows:
        assert all(row.get(field) is not None for field in ROW_FIELDS), row
        assert row["model"] == "builtin" and row["label"] == "ci"
        n = row["clients"]
        assert row["requests"] == row["completed"] == 2 * n and not row["failures"]
        # every reply had max_tokens tokens (EOS banned), and the clients received each of them
        assert row["completion_tokens"] == row["received_tokens"] == 2 * n * 4
        assert row["aggregate_tok_s"] * row["wall_s"] == pytest.approx(row["completion_tokens"], rel=0.05)
        assert row["budget"] == 768  # the built-in model's default: 0.75 x 1024 positions
        assert 0 < row["max_active_tokens"] <= row["budget"]
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"]
        assert 0 < row["itl_p50_ms"] <= row["itl_p95_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"]
        assert row["decode_tok_s"] > 0
        # the built-in's K/V per token in kvos serve's default float16 pool: 4 layers x 2 heads x 64 x 2 x 2
        assert row["pool_bytes_peak"] >= row["max_active_tokens"] * 2048
        assert row["rss_peak_mb"] > 0
        # what the sessions held at the end, from /v1/sessions: every token resident, at the pool's bytes
        assert 0 < row["resident_tokens"] <= row["max_active_tokens"]
        assert row["resident_bytes_per_token"] == 2048 and row["saved_bytes_per_token"] is None
        assert row["wall_s"] > 0 and row["sessions"] == n  # one session per client, deleted after the run
        # the scheduler's counters over the run: its steps' forward passes and the turns between them
        assert 0 < row["turns_share"] < 1 and row["forward_ms_step"] > 0 and row["turns_ms_step"] > 0
        share = row["turns_ms_step"] / (row["turns_ms_step"] + row["forward_ms_step"])
        assert share == pytest.approx(row["turns_share"], abs=0.01)


def test_decode_rate_counts_overlapping_decode_phases_once() -> None:
    """Tokens after each reply's first over the union of the decode intervals: [0, 2] and [1, 3] overlap
    (3 s covered), [5, 6] adds 1 s; 4 + 4 + 2 tokens in 4 s."""
    assert decode_rate([(1.0, 3.0, 4), (0.0, 2.0, 4), (5.0, 6.0, 2)]) == 2.5
    assert decode_rate([(0.0, 4.0, 8), (1.0, 2.0, 2)]) == 2.5  # one inside the other
    assert decode_rate([]) == 0.0


def test_the_turns_share_is_the_runs_own() -> None:
    """The counters' differences over a run, not their totals since the server started; no step between
    the two looks gives no figures (not a division by zero)."""
    from kvos.bench.soak_server import SchedulerTime

    before, after = SchedulerTime(10, 2.0, 0.5, 0.02, 1), SchedulerTime(30, 3.5, 1.0, 0.1455, 2)
    assert after.since(before) == {
        "turns_share": 0.25,
        "forward_ms_step": 75.0,
        "turns_ms_step": 25.0,
        "gc_pause_ms": 125.5,
        "gc_full": 1,
    }
    keys = ("turns_share", "forward_ms_step", "turns_ms_step", "gc_pause_ms", "gc_full")
    assert before.since(before) == dict.fromkeys(keys)
    text = (
        "# TYPE kvos_scheduler_steps_total counter\nkvos_scheduler_steps_total 7.0\n"
        "# TYPE kvos_scheduler_forward_seconds_total counter\nkvos_scheduler_forward_seconds_total 1.5\n"
        "# TYPE kvos_scheduler_turn_seconds_total counter\nkvos_scheduler_turn_seconds_total 0.25\n"
        "# TYPE kvos_gc_collections_total counter\n"
        'kvos_gc_collections_total{generation="0"} 40.0\nkvos_gc_collections_total{generation="2"} 3.0\n'
        "# TYPE kvos_gc_pause_seconds_total counter\n"
        'kvos_gc_pause_seconds_total{generation="0"} 0.25\nkvos_gc_pause_seconds_total{generation="2"} 0.5\n'
    )
    from kvos.bench.soak_server import parse_metrics

    assert parse_metrics(text)["scheduler"] == SchedulerTime(7, 1.5, 0.25, 0.75, 3)
    assert parse_metrics(text.split("# TYPE kvos_scheduler_turn")[0])["scheduler"] is None


def test_a_peer_server_gets_the_same_load(tmp_path: Path) -> None:
    """A peer (here kvos serve itself, started by its own command line as llama-server would be) is driven
    by the same clients; its rows carry the peer's label and only the clients' figures."""
    import sys
    import time

    def launch(port: int) -> list[str]:
        return [sys.executable, "-m", "kvos.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]

    args = serve_args("--turns", "2", "--max-tokens", "3")
    peer = serve.Peer("peer -np 2", launch)
    # the deadline is the bench's own guard (no client count starts after it), not a timing assertion: the
    # peer's start-up may take minutes on a loaded 2-core machine, and a run past it would have no rows
    rows = serve.bench_model("builtin", None, [2], args, time.monotonic() + 900, tmp_path, peer)
    assert len(rows) == 1
    row = rows[0]
    assert row["label"] == "peer -np 2" and row["clients"] == 2
    assert row["requests"] == row["completed"] == 4 and not row["failures"]
    assert row["completion_tokens"] == row["received_tokens"] == 4 * 3
    assert row["max_active_tokens"] is None and row["budget"] is None and row["sessions"] == 0
    assert row["turns_share"] is None and row["forward_ms_step"] is None
    assert (tmp_path / "builtin-peer.log").is_file()


class OneShotServer:
    """A raw HTTP server on 127.0.0.1 that closes the first ``drops`` connections without an answer (a
    kept-alive connection the server let go as the client reused it), with a FIN or, with ``reset``, an
    RST, and answers the others with a one-token stream."""

    STREAM = (
        'data: {"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [{"token": "a"}]}}]}\n\n'
        'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n'
    )

    def __init__(self, drops: int, reset: bool = False) -> None:
        import socket
        import threading

        self.drops, self.reset, self.accepted = drops, reset, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    @staticmethod
    def read_request(conn: Any) -> None:
        """Read one whole request (head and Content-Length body), so a plain close sends a FIN only."""
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length:\s*(\d+)", head)
        need = int(length.group(1)) if length else 0
        while len(body) < need:
            body += conn.recv(65536)

    def serve(self) -> None:
        import socket

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.read_request(conn)
                self.accepted += 1
                if self.accepted <= self.drops:
                    if self.reset:  # linger 0: close sends an RST
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue  # closed with no answer
                body = self.STREAM.encode()
                head = (
                    f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {len(body)}\r\n"
                )
                conn.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_request_on_a_connection_the_server_dropped_goes_once_more(reset: bool) -> None:
    from kvos.bench.serve_client import Plan, RequestFailed, TimedClient, Timings

    plan = Plan("m", 1, 1, {}, deadline=float("inf"))
    server = OneShotServer(drops=1, reset=reset)
    client = TimedClient(0, server.url, "s", plan, Timings(), seed=0)
    reply = client.stream(client.body())
    assert reply.text == "a" and len(reply.stamps) == 1 and server.accepted == 2
    server = OneShotServer(drops=2, reset=reset)  # dropped twice: a failure, counted as such
    client = TimedClient(0, server.url, "s", plan, Timings(), seed=0)
    with pytest.raises(RequestFailed, match="stale_connection"):
        client.stream(client.body())
    assert server.accepted == 2


def test_message_words_bound_the_user_messages() -> None:
    assert serve.message_words("200,240") == (200, 240)
    for bad in ("0,5", "9,3", "12", "a,b"):
        with pytest.raises(ConfigError, match="--message-words"):
            serve.message_words(bad)
    assert serve_args().message_words == "8,24"  # the short notes the figures so far were measured with
