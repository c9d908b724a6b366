"""The memory map at ``/ui``, in a real headless Chromium (Debian's ``chromium``, which ``.ci/run``
installs) driven by Playwright, against ``kvos serve`` on the built-in model with its defaults and two API
keys: the page asks for the key, shows the key's sessions and not another key's, reflects the evictions a
further request causes without a reload, pins a chunk through its detail panel, and the next request keeps
that chunk; sessions made and deleted meanwhile come and go; no console errors on the way.
``KVOS_UI_SCREENSHOT=docs/memory-map.png`` writes the README's screenshot of the map from this run."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import MODEL_NAME, running_server
from test_inspector import KEYS, RULES
from test_inspector import chat as keyed_chat

from kvos.builtin import MODEL_DIR

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine (.ci/run installs Debian's chromium package)"
)
FLAGS = [  # a closed network: without the background-networking flags Chromium keeps dialling out
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SAVED = '[data-session="agent"] .chunk[data-state="saved"]'


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_server(MODEL_DIR, api_keys=["key-one", "key-two"]) as u:  # the inspector tests' keys
        yield u


def chat(url: str, sid: str, messages: list[dict[str, Any]], key: str = "one") -> dict[str, Any]:
    """The inspector tests' request, its reply appended to ``messages`` as a client would."""
    reply = keyed_chat(url, sid, messages, key)
    messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return reply


def chunks(url: str, sid: str) -> dict[int, dict[str, Any]]:
    r = httpx.get(f"{url}/sessions/{sid}", headers=KEYS["one"], params={"events": 1000}, timeout=60)
    r.raise_for_status()
    return {c["id"]: c for c in r.json()["chunks"]}


STRIP = (  # the agent session's strip as the page draws it: chunk id -> its state, as JSON
    "JSON.stringify(Object.fromEntries([...document.querySelectorAll('[data-session=\"agent\"] .chunk')]"
    ".map(e => [e.dataset.chunk, e.dataset.state])))"
)


def states(url: str) -> str:
    """The agent session's chunk states as the server has them, in the page's JSON (ids ascending)."""
    found = {str(cid): c["state"] for cid, c in sorted(chunks(url, "agent").items())}
    return json.dumps(found, separators=(",", ":"))


def test_the_map_follows_a_session_live_and_pins_a_chunk(url: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are a coding agent. {RULES}"}]
    messages.append({"role": "user", "content": "Note 0: my favourite number is 40."})
    chat(url, "agent", messages)
    chat(url, "notes", [{"role": "user", "content": "A second session of the same key."}])
    chat(url, "other", [{"role": "user", "content": "A session of another key."}], key="two")
    root = url.removesuffix("/v1")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 640})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{root}/ui")
        page.wait_for_selector("#key-form:not([hidden])")  # the server has keys: the page asks first
        page.fill("#key", "key-one")
        page.click("#key-form button")
        page.wait_for_selector('[data-session="agent"] .chunk')
        page.wait_for_selector("#live:not(.off)")  # the event stream is open
        page.wait_for_selector('[data-session="notes"] .chunk')
        assert page.locator('[data-session="other"]').count() == 0  # key two's session is not shown
        assert page.evaluate(STRIP) == states(url)
        saved_before = page.locator(SAVED).count()

        for i in range(1, 4):  # past the budget: chunks are paged out, and the page shows it unreloaded
            messages.append({"role": "user", "content": f"Note {i}: my favourite number is {40 + i}."})
            chat(url, "agent", messages)
        page.wait_for_function(f"document.querySelectorAll('{SAVED}').length > {saved_before}")
        page.wait_for_function(f"want => {STRIP} === want", arg=states(url))  # settles on the server's

        target = next(cid for cid, c in chunks(url, "agent").items() if c["state"] == "saved")
        page.click(f'[data-session="agent"] .chunk[data-chunk="{target}"]')
        page.wait_for_selector("#detail:not([hidden])")
        assert page.text_content("#pin") == "Pin" and "evict" in page.text_content("#history")
        page.click("#pin")
        page.wait_for_selector(f'.chunk[data-chunk="{target}"].pinned[data-state="resident"]')
        assert page.text_content("#pin") == "Unpin"
        assert chunks(url, "agent")[target]["keep"] == "pin"

        messages.append({"role": "user", "content": "And another note: the sky is green. " * 10})
        reply = chat(url, "agent", messages)  # evicts again, but not the pinned chunk
        assert reply["usage"]["kvos"]["evictions"] > 0
        assert chunks(url, "agent")[target]["state"] == "resident"
        page.wait_for_function(f"document.querySelectorAll('{SAVED}').length > 0")
        assert page.get_attribute(f'.chunk[data-chunk="{target}"]', "data-state") == "resident"
        shot = os.environ.get("KVOS_UI_SCREENSHOT")
        page.screenshot(path=shot or str(tmp_path / "memory-map.png"))

        assert page.locator('[data-session="agent"] .compression').count() == 0  # none: nothing to show
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Compress this session. " * 60}],
            "max_tokens": 4,
            "kvos": {"kv_compression": "sparse:sweet"},
        }
        headers = {**KEYS["one"], "X-Session-Id": "packed"}
        r = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        page.wait_for_selector('[data-session="packed"] .compression')
        assert "sparse:sweet" in page.text_content('[data-session="packed"] .counters')

        chat(url, "later", [{"role": "user", "content": "A session opened while the page is open."}])
        page.wait_for_selector('[data-session="later"] .chunk')  # it appears, and a deleted one goes
        assert httpx.delete(f"{url}/sessions/notes", headers=KEYS["one"], timeout=60).status_code == 200
        page.wait_for_selector('[data-session="notes"]', state="detached")
        browser.close()
    assert errors == []
