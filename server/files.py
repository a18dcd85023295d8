"""Files a client handed this worker as descriptors (a model's external data): one slot per handle, empty
until the descriptor arrives on the descriptor socket (Worker.ImportFile, then the ticket).

A worker maps what it is handed, and a mapping whose file its owner shrinks makes the next access to the lost pages
die with SIGBUS. So nothing a client can shrink is mapped by a worker others share: a memfd must be sealed against
shrinking (it is sealed as it is imported where its descriptor allows); a regular file is copied, by pread, into
the worker's blob cache, and the copy mapped (and opened by ONNX Runtime, by its path there, which no client
names). A worker launched by one application for itself maps that application's files as they are: only it can
shrink them, and it could as well signal its worker."""
from __future__ import annotations

import fcntl
import os
import stat
import threading

from ephost.errors import EpFailedPrecondition, EpInvalidArgument
from ephost.external_data import ExternalFile

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def mappable(fd: int, shared: bool, cache) -> int:
    """A descriptor of what `fd` (owned from here on) holds that no client can shrink under a mapping: `fd` itself
    where it is a sealed memfd or (not `shared`) a file of the launching application's, else a descriptor of its
    copy in `cache` (server.blob_cache.BlobCache, or None: none). Raises, `fd` closed, where it can be neither."""
    try:
        if not shared or _seal(fd):
            return fd
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise EpInvalidArgument("an imported file must be a regular file or a memfd")
        if cache is None:
            raise EpFailedPrecondition("a worker others share copies imported files into its blob cache, and this "
                                       "one has none (--cache-max-mb 0): hand over a sealed memfd")
        digest = cache.take(fd, os.fstat(fd).st_size)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return cache.open(digest, "an imported file")


def _seal(fd: int) -> bool:
    """Whether `fd` is a memfd (of those, one that takes seals), sealed against changing size (as it is here, where
    it was not and its descriptor allows); raises where it is a memfd that cannot be sealed."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False  # no memfd: a file of a file system that knows no seals
    if seals & fcntl.F_SEAL_SHRINK:
        return True
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError:
        raise EpInvalidArgument("an imported memfd must be sealed against shrinking (F_SEAL_SHRINK), or made with "
                                "MFD_ALLOW_SEALING and handed over writable, so that the worker seals it") from None
    return True


class FileSlot:
    def __init__(self, handle_label: str):
        self._label = handle_label
        self._file: ExternalFile | None = None
        self._lock = threading.Lock()  # guards _file

    def attach(self, fd: int) -> ExternalFile:
        """Take the descriptor (owned from here on): refused, and closed, unless it is a regular file and the
        slot is still empty."""
        with self._lock:
            if self._file is not None:
                os.close(fd)
                raise EpFailedPrecondition(f"{self._label} already has its file")
            self._file = ExternalFile(self._label, fd)  # closes fd and raises where it is no regular file
            return self._file

    def get(self) -> ExternalFile:
        with self._lock:
            if self._file is None:
                raise EpFailedPrecondition(f"{self._label} has no file yet: hand its descriptor over with the "
                                           "ticket Worker.ImportFile gave")
            return self._file

    def close(self) -> None:
        with self._lock:
            f, self._file = self._file, None
        if f is not None:
            f.close()
