"""Files a client handed this worker as descriptors (a model's external data): one slot per handle, empty
until the descriptor arrives on the descriptor socket (Worker.ImportFile, then the ticket)."""
from __future__ import annotations

import os
import threading

from ephost.errors import EpFailedPrecondition
from ephost.external_data import ExternalFile


class FileSlot:
    def __init__(self, handle_label: str):
        self._label = handle_label
        self._file: ExternalFile | None = None
        self._lock = threading.Lock()

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
