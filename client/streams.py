"""A worker's sync streams and notifications, seen from the client (OrtSyncStreamImpl over gRPC)."""
from __future__ import annotations

from typing import Mapping

from ephost.client.handles import RemoteHandle
from ephost.client.supervisor import WorkerLink
from ephost.v1 import common_pb2, factory_pb2, stream_pb2


class RemoteStream(RemoteHandle):
    def __init__(self, link: WorkerLink, device_index: int, options: Mapping[str, str]):
        super().__init__(link)
        self._device_index, self._options = device_index, dict(options)
        self.handle

    def _make(self) -> int:
        return self.link.call(lambda c: c.factory.CreateSyncStreamForDevice, factory_pb2.CreateSyncStreamRequest(
            device_index=self._device_index, options=self._options)).id

    def create_notification(self) -> "RemoteNotification":
        return RemoteNotification(self.link, self)

    def flush(self, timeout: float | None = None) -> None:
        self.call(lambda c: c.stream.Flush, lambda h: common_pb2.Handle(id=h), timeout=timeout)

    def on_session_run_end(self) -> None:
        self.call(lambda c: c.stream.OnSessionRunEnd, lambda h: common_pb2.Handle(id=h))

    def release(self) -> None:
        if self.current:
            self.call(lambda c: c.stream.Release, lambda h: common_pb2.Handle(id=h))


class RemoteNotification(RemoteHandle):
    def __init__(self, link: WorkerLink, stream: RemoteStream):
        super().__init__(link)
        self._stream = stream
        self.handle

    def _make(self) -> int:
        return self.link.call(lambda c: c.stream.CreateNotification, common_pb2.Handle(id=self._stream.handle)).id

    def activate(self) -> None:
        self.call(lambda c: c.stream.Activate, lambda h: common_pb2.Handle(id=h))

    def wait_on_host(self, timeout: float | None = None) -> None:
        self.call(lambda c: c.stream.WaitOnHost,
                  lambda h: stream_pb2.WaitOnHostRequest(notification=h, timeout_s=timeout or 0.0),
                  timeout=(timeout + 5.0) if timeout else None)

    def wait_on_device(self, stream: RemoteStream) -> None:
        self.call(lambda c: c.stream.WaitOnDevice,
                  lambda h: stream_pb2.WaitOnDeviceRequest(notification=h, stream=stream.handle))

    def release(self) -> None:
        if self.current:
            self.call(lambda c: c.stream.Release, lambda h: common_pb2.Handle(id=h))
