"""The transit bucket, the one storage layer of the orchestrator and of the jobs on the GPU nodes.

A :class:`LocalTransitBucket` (``file:///abs/root``) or an :class:`S3TransitBucket` (``s3://bucket/prefix``:
boto3's transfer manager, botocore's retries). Keys are ``/``-separated and relative to the root. A folder is
complete once :meth:`TransitBucket.publish` has written its ``_manifest.json``, always last. Jobs address
objects by URI (:func:`bucket_for_uri` and the functions after it). No Dagster: GPU nodes import this.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)


def gpudoor_home() -> Path:
    """``$GPUDOOR_HOME``, else ``~/.gpudoor``: where this machine keeps the door's state (the embedded default's
    jobs and transit folder, what SkyPilot read of task files)."""
    home = os.environ.get("GPUDOOR_HOME")
    return Path(home).expanduser() if home else Path.home() / ".gpudoor"


MANIFEST_NAME = "_manifest.json"
"""File name of the manifest of a published folder; written last, so its presence means complete."""
TMP_PREFIX = ".tmp-"
#: Where Dagster Pipes keeps a session's context and messages while it lives (see ``transit.pipes``).
PIPES_PREFIX = "_pipes"
#: Where the IO manager keeps what it stores for assets (see ``transit.io_manager``).
ASSETS_PREFIX = "assets"
"""Name prefix of local temp files (a write in flight, or killed midway); never listed."""
MiB = 1024 * 1024
FileData = bytes | str | os.PathLike
"""What :meth:`TransitBucket.publish` stores per file: the bytes, or the path of a local file."""


class TransitError(Exception):
    """Base class of transit bucket errors."""


class TransitConfigError(TransitError):
    """The bucket is misconfigured (credentials, bucket, endpoint...); the message names the setting."""


class TransitObjectMissing(TransitError, FileNotFoundError):
    """No object at ``key`` (full address: ``uri``)."""

    def __init__(self, key: str, uri: str, message: str | None = None):
        self.key, self.uri = key, uri
        super().__init__(message or f"transit object {key!r} does not exist (looked for {uri})")


def _clean(key: str, *, allow_empty: bool = False) -> str:
    """Strip surrounding slashes; reject keys that could leave the root or that S3 would mangle."""
    k = key.strip("/")
    if "\x00" in k or "\\" in k or (not k and not allow_empty) or (k and {"", ".", ".."} & set(k.split("/"))):
        raise ValueError(f"invalid transit key {key!r}: no empty, '.' or '..' segments, no NUL or backslash")
    return k


def _folder(prefix: str) -> str:
    """``'a/b'`` -> ``'a/b/'``, so that ``runs/7`` never matches ``runs/70``; ``''`` stays ``''``."""
    return _clean(prefix, allow_empty=True) + "/" if prefix.strip("/") else ""


class TransitBucket(abc.ABC):
    """A place both the orchestrator and the jobs read and write; see the module docstring."""

    root_uri: str
    """``file:///abs/root`` or ``s3://bucket/prefix``, without a trailing slash."""

    def uri(self, key: str) -> str:
        """Full URI of ``key``; ``uri("")`` is the root."""
        k = _clean(key, allow_empty=True)
        return f"{self.root_uri}/{k}" if k else self.root_uri

    def key_of(self, uri: str) -> str:
        """Inverse of :meth:`uri`; a ValueError if ``uri`` is outside this bucket."""
        if uri.rstrip("/") == self.root_uri:
            return ""
        if not uri.startswith(self.root_uri + "/"):
            raise ValueError(f"{uri!r} is outside the transit bucket {self.root_uri!r}")
        return _clean(uri[len(self.root_uri) + 1 :], allow_empty=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write an object atomically: readers see the old object, none, or all of ``data``."""
        self._put_many({_clean(key): data})

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read an object (:class:`TransitObjectMissing` when there is none)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object exists at exactly ``key``."""

    @abc.abstractmethod
    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        """Keys starting with the raw string ``prefix``, recursively, in UTF-8 byte order; ``start_after``
        is exclusive, like S3's ``StartAfter``, so a sensor can keep the last key it saw as its cursor."""

    @abc.abstractmethod
    def list_sized(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of the keys :meth:`list_keys` lists, in the same order: the sizes come
        with the listing (S3's ``Size``), so telling empty objects apart costs no request per object."""

    @abc.abstractmethod
    def _put_many(self, items: Mapping[str, FileData]) -> None:
        """Store every (key, bytes or local path) at once, each atomically; raise on the first failure."""

    def publish(self, prefix: str, manifest: dict, files: Mapping[str, FileData] | None = None) -> str:
        """Upload ``files`` (relative name -> bytes or local path) concurrently, then write
        ``<prefix>/_manifest.json`` last: a reader that sees the manifest sees every file, and a writer that
        fails or is killed leaves no manifest and no partial object. Returns the manifest's key."""
        folder = _folder(prefix)
        items = {folder + _clean(rel): data for rel, data in (files or {}).items()}
        if folder + MANIFEST_NAME in items:
            raise ValueError(f"{MANIFEST_NAME} is written by publish() itself; pass it as `manifest`")
        if items:
            self._put_many(items)
        self.put_bytes(folder + MANIFEST_NAME, json.dumps(manifest, indent=1, default=str).encode())
        return folder + MANIFEST_NAME

    def read_manifest(self, prefix: str) -> dict | None:
        """The manifest of a published folder, or None while it is not published."""
        try:
            return json.loads(self.get_bytes(_folder(prefix) + MANIFEST_NAME))
        except TransitObjectMissing:
            return None

    def job_env(self) -> dict[str, str]:
        """Non-secret environment a job needs to reach the bucket."""
        return {}

    def job_secrets(self) -> dict[str, str]:
        """Credentials a job needs (pass them as SkyPilot secrets, so they are redacted)."""
        return {}

    def check(self) -> None:  # noqa: B027 (nothing to check on a folder)
        """Make one cheap request; raise :class:`TransitConfigError` naming the setting to fix."""

    def close(self) -> None:  # noqa: B027
        """Release threads and connections; the bucket stays usable (they come back on demand)."""

    def folder_version(self, prefix: str) -> str | None:
        """A token that changes when an entry is added directly under the folder ``prefix`` (``a/b/``), for a
        caller that lists it only when it changed; None where the storage has none (S3: list every time)."""
        return None


def _atomic_write(dest: Path, data: FileData) -> None:
    """Write through a temp file in the destination folder, then rename: all or nothing."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                with open(data, "rb") as src:
                    shutil.copyfileobj(src, f, 8 * MiB)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the object from the folder's other users
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class LocalTransitBucket(TransitBucket):
    """The folder ``root`` (created if missing) as the transit bucket, for jobs run as local processes."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root_uri = "file://" + self.root.as_posix().rstrip("/")

    def path_of(self, key: str) -> Path:
        """Local path of a key."""
        return self.root / _clean(key, allow_empty=True)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.path_of(_clean(key)).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise TransitObjectMissing(key, self.uri(key)) from None

    def exists(self, key: str) -> bool:
        return self.path_of(_clean(key)).is_file()

    def folder_version(self, prefix: str) -> str | None:
        # A folder's modification time moves when an entry is added to it or removed (not deeper down).
        try:
            return str(os.stat(self.path_of(prefix.strip("/"))).st_mtime_ns)
        except OSError:
            return ""

    def _put_many(self, items: Mapping[str, FileData]) -> None:
        with concurrent.futures.ThreadPoolExecutor(min(16, len(items))) as pool:
            list(pool.map(lambda item: _atomic_write(self.path_of(item[0]), item[1]), items.items()))

    def _listed(self, prefix: str, start_after: str | None) -> Iterator[str]:
        """Keys starting with ``prefix`` and greater than ``start_after``, sorted, lazily: from the folder
        named by ``prefix`` up to its last '/', one scandir per folder that can hold such a key."""
        prefix = prefix.lstrip("/")
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        # str order is code point order, which is UTF-8 byte order, S3's
        yield from self._walk(self.path_of(base), _folder(base), prefix, start_after or "")

    def _walk(self, folder: Path, rel: str, prefix: str, after: str) -> Iterator[str]:
        """The keys of :meth:`_listed` under ``folder`` (whose keys start with ``rel``). Entries sort by
        what they put before the rest of their keys (``name/`` for a folder, ``name`` for a file), so
        the keys of one entry all sort before those of the next; entries whose keys all are at or
        before ``after``, or none of which can start with ``prefix``, are skipped unopened."""
        entries: list[tuple[str, str, bool]] = []  # (head of its keys, name, is a folder)
        try:
            with os.scandir(folder) as it:  # read whole, then closed: no folder held open while yielding
                for entry in it:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    if is_dir and entry.is_symlink():  # os.walk's default: neither listed nor followed
                        continue
                    if is_dir or not entry.name.startswith(TMP_PREFIX):
                        entries.append((rel + entry.name + ("/" if is_dir else ""), entry.name, is_dir))
        except OSError:  # gone, unreadable or not a folder: no keys, as with os.walk
            return
        entries.sort()
        for head, name, is_dir in entries:
            if not is_dir:
                if head > after and head.startswith(prefix):
                    yield head
            elif (head > after or after.startswith(head)) and (head.startswith(prefix) or prefix.startswith(head)):
                yield from self._walk(folder / name, head, prefix, after)

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        yield from self._listed(prefix, start_after)  # no stat per file: listings of many keys stay cheap

    def list_sized(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]:
        for key in self._listed(prefix, start_after):
            try:
                size = os.stat(self.root / key).st_size
            except OSError:  # deleted since the walk, or a dangling link: listed, like list_keys does
                size = 0
            yield key, size
