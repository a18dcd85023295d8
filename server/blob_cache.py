"""The worker's disk cache of content-addressed blobs: a model's external data files from clients that share no
memory with the worker (another host, or `shared_memory=false`). A blob is named by the sha256 of its bytes;
it arrives in chunks into `<sha256>.part` (an interrupted upload resumes where it stopped) and becomes
`<sha256>` once all its bytes are there and hash to its name. A blob a second session, a second client or a
reconnect names is already here: nothing is sent again. Past the size limit the least recently used blobs
go (a blob in use stays mapped: its pages outlive the name)."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading

from ephost.errors import EpFailedPrecondition, EpInvalidArgument, EpNotFound, EpResourceExhausted, quoted

log = logging.getLogger(__name__)

_DIGEST = re.compile(r"[0-9a-f]{64}")
HASH_CHUNK = 8 << 20


def check_digest(digest: str) -> str:
    if not _DIGEST.fullmatch(digest):
        raise EpInvalidArgument("a blob is named by the lowercase hex sha256 of its bytes (64 characters)")
    return digest


class BlobCache:
    def __init__(self, directory: str, max_bytes: int):
        self.directory = directory
        self.max_bytes = max_bytes  # made when the first blob arrives
        self._lock = threading.Lock()  # guards _writing
        self._writing: set[str] = set()

    def _path(self, digest: str, part: bool = False) -> str:
        return os.path.join(self.directory, check_digest(digest) + (".part" if part else ""))

    def status(self, digest: str) -> tuple[bool, int]:
        """(complete, bytes of it here): the bytes of an interrupted upload count, so that it resumes."""
        try:
            os.utime(self._path(digest))  # used: the last to go
            return True, os.path.getsize(self._path(digest))
        except FileNotFoundError:
            pass
        try:
            return False, os.path.getsize(self._path(digest, part=True))
        except FileNotFoundError:
            return False, 0

    def write(self, digest: str, nbytes: int, offset: int, data: bytes) -> tuple[bool, int]:
        """Append a chunk at `offset` (which must be where the blob's bytes stop); the blob is complete, and
        checked against its name, when it has `nbytes`. Returns status()."""
        if nbytes < 0 or nbytes > self.max_bytes:
            raise EpResourceExhausted(f"a blob of {nbytes} bytes is over this worker's cache ({self.max_bytes} "
                                      "bytes, --cache-max-mb)")
        part = self._path(digest, part=True)
        with self._lock:
            if digest in self._writing:
                raise EpFailedPrecondition("this blob is being uploaded by another call")
            self._writing.add(digest)
        try:
            complete, have = self.status(digest)
            if complete:
                return complete, have
            if offset != have:
                raise EpInvalidArgument(f"a chunk at offset {offset}, where this blob has {have} bytes: resume there")
            if have + len(data) > nbytes:
                raise EpInvalidArgument(f"chunks past the blob's {nbytes} bytes")
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            if have == 0:
                self.evict(keep=digest + ".part")  # room for a new upload: stopped ones count too
            with open(part, "ab") as f:
                f.write(data)
            have += len(data)
            if have == nbytes:
                self._seal(digest, part)
                return True, have
            return False, have
        finally:
            with self._lock:
                self._writing.discard(digest)

    def _seal(self, digest: str, part: str) -> None:
        h = hashlib.sha256()
        with open(part, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
        if h.hexdigest() != digest:
            os.unlink(part)
            raise EpInvalidArgument("the blob's bytes do not hash to its name; it was discarded: upload it again")
        os.replace(part, self._path(digest))
        self.evict(keep=digest)

    def take(self, fd: int, nbytes: int) -> str:
        """Copy `nbytes` of an open file into the cache, named by their hash (the digest returned; a blob already
        here is kept as it is). Read by pread, never mapped: a file its owner shrinks meanwhile ends the copy with
        an error, not a fault."""
        if nbytes > self.max_bytes:
            raise EpResourceExhausted(f"a file of {nbytes} bytes is over this worker's cache ({self.max_bytes} "
                                      "bytes, --cache-max-mb)")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self.evict()
        part = self._path(secrets.token_hex(32), part=True)  # an upload's name: eviction clears one left behind
        h = hashlib.sha256()
        try:
            with open(part, "xb") as out:
                offset = 0
                while offset < nbytes:
                    chunk = os.pread(fd, min(HASH_CHUNK, nbytes - offset), offset)
                    if not chunk:
                        raise EpInvalidArgument(f"the file became shorter than its {nbytes} bytes as it was copied")
                    h.update(chunk)
                    out.write(chunk)
                    offset += len(chunk)
            digest = h.hexdigest()
            if self.status(digest)[0]:
                os.unlink(part)
            else:
                os.replace(part, self._path(digest))
        except BaseException:
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass
            raise
        self.evict(keep=digest)
        return digest

    def open(self, digest: str, name: str) -> int:
        """A read-only descriptor of the complete blob (to be mapped); NOT_FOUND where it is not (all) here."""
        try:
            fd = os.open(self._path(digest), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise EpNotFound(f"external data {quoted(name)} is not in this worker's cache: upload it "
                             "(Worker.PutBlob) first") from None
        os.utime(fd)
        return fd

    def evict(self, keep: str = "") -> int:
        """Remove the least recently used blobs (and uploads that stopped) until the cache is within its limit;
        returns how many bytes went."""
        entries = []
        if not os.path.isdir(self.directory):
            return 0
        for entry in os.scandir(self.directory):
            if entry.is_file() and _DIGEST.fullmatch(entry.name.removesuffix(".part")):
                st = entry.stat()
                entries.append((st.st_mtime, entry.name, st.st_size))
        total = sum(size for _, _, size in entries)
        freed = 0
        for _, name, size in sorted(entries):
            if total - freed <= self.max_bytes:
                break
            with self._lock:
                busy = name.removesuffix(".part") in self._writing
            if name == keep or busy:
                continue
            try:
                os.unlink(os.path.join(self.directory, name))
                freed += size
                log.info("blob cache: removed %s (%d bytes) to stay under %d bytes", name[:12], size,
                         self.max_bytes)
            except FileNotFoundError:
                pass
        return freed
