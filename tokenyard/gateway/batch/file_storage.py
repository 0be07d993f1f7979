"""Where the bytes of Batch API files live: one small interface, and the local-disk implementation.

    storage = DiskStorage(Path(".tokenyard/batch"))
    storage.put("acme", "file-abc", source)     # whole or not at all
    with storage.open("acme", "file-abc") as f: ...
    storage.delete("acme", "file-abc")

The metadata (owner, name, size, purpose) is in Redis (file_records.py); this only stores bytes,
so an object store (S3 put/get/delete) can replace the disk by implementing `FileStorage`.
Every method blocks (file I/O, fsync): callers run them in a worker thread.

Disk layout: `{data_dir}/{tenant}/{file_id}` (a tenant name starting with a dot gets a "_" in
front). A put writes `.{file_id}.{random}.tmp` in the same folder, fsyncs it, renames it over the
final name (atomic on POSIX) and fsyncs the folder, so a crash leaves either the whole file or none
of it (plus at most a stray .tmp, removed by `sweep`).
"""
from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Protocol

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")   # tenants (api_keys._TENANT) and file ids: no path tricks


class FileStorage(Protocol):
    def put(self, tenant: str, file_id: str, chunks: Iterable[bytes]) -> int:
        """Store the bytes durably; return how many. Replaces any earlier content of the id."""

    def open(self, tenant: str, file_id: str) -> BinaryIO:
        """A readable binary file object (FileNotFoundError when absent)."""

    def delete(self, tenant: str, file_id: str) -> None:
        """Remove the bytes; absent already is fine."""


class DiskStorage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _path(self, tenant: str, file_id: str) -> Path:
        if not _NAME.match(tenant) or not _NAME.match(file_id) or file_id.startswith("."):
            raise ValueError(f"bad tenant or file id: {tenant!r} {file_id!r}")
        # Tenant names may start with a dot (even be ".."): such a folder gets a "_" in front, so no
        # tenant's folder is the data folder itself, its parent or hidden. (File ids are random and
        # every read goes through the tenant's record, so two names sharing a folder share nothing.)
        folder = "_" + tenant if tenant.startswith(".") else tenant
        return self.root / folder / file_id

    def put(self, tenant: str, file_id: str, chunks: Iterable[bytes]) -> int:
        final = self._path(tenant, file_id)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{file_id}.{secrets.token_hex(4)}.tmp"
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(final.parent)
        return size

    def open(self, tenant: str, file_id: str) -> BinaryIO:
        return open(self._path(tenant, file_id), "rb")

    def delete(self, tenant: str, file_id: str) -> None:
        path = self._path(tenant, file_id)
        path.unlink(missing_ok=True)
        _fsync_dir(path.parent)

    def sweep(self, older_than_s: float = 3600.0) -> None:
        """Remove .tmp files a crash left behind (at start-up); recent ones may be another gateway's
        upload in progress on a shared folder."""
        if not self.root.is_dir():
            return
        cutoff = time.time() - older_than_s
        for tmp in self.root.glob("*/.*.tmp"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink(missing_ok=True)
            except OSError:
                pass


def _fsync_dir(path: Path) -> None:
    """Make a rename or unlink in `path` durable (the directory entry itself)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class InputMissing(FileNotFoundError):
    """A batch's input file has no bytes in the storage (deleted, or lost behind the gateway's back):
    the batch can never read it again, so it ends (batch_runner.py) instead of being retried."""

    def __init__(self, file_id: str) -> None:
        super().__init__(f"the input file {file_id} is gone from the file storage")
        self.file_id = file_id


def line_chunks(storage: FileStorage, tenant: str, file_id: str, size: int = 256) -> Iterator[list[tuple[int, bytes]]]:
    """A stored JSONL file's lines as (index, bytes) in chunks of `size`; blocking, so callers take one
    chunk at a time in a worker thread (`await asyncio.to_thread(next, chunks, None)`). InputMissing
    (on the first chunk) when the file is not there."""
    try:
        f = storage.open(tenant, file_id)
    except FileNotFoundError as e:
        raise InputMissing(file_id) from e
    with f:
        index, chunk = 0, []
        for raw in f:
            chunk.append((index, raw))
            index += 1
            if len(chunk) >= size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
