"""EpFactory over gRPC (OrtEpFactory)."""
from __future__ import annotations

from ephost.types import MemoryInfo
from ephost.server.rpc import rpc
from ephost.server.state import WorkerState
from ephost.v1 import common_pb2, factory_pb2, factory_pb2_grpc


class EpFactoryService(factory_pb2_grpc.EpFactoryServicer):
    SERVICE = "EpFactory"

    def __init__(self, state: WorkerState):
        self.state = state

    def _client(self, context):
        return self.state.clients.lookup(context.invocation_metadata())

    @rpc
    def GetInfo(self, request, context):
        f = self.state.factory
        return factory_pb2.FactoryInfo(name=f.get_name(), vendor=f.get_vendor(), vendor_id=f.get_vendor_id(),
                                       version=f.get_version())

    @rpc
    def GetSupportedDevices(self, request, context):
        return factory_pb2.SupportedDevices(devices=[d.to_proto() for d in self.state.devices])

    @rpc
    def CreateEp(self, request, context):
        client = self._client(context)
        for i in request.device_indices:
            self.state.device(i)
        ep = self.state.factory.create_ep(list(request.device_indices), dict(request.session_options))
        return common_pb2.Handle(id=client.add("ep", ep))

    @rpc
    def ReleaseEp(self, request, context):
        self.state.factory.release_ep(self._client(context).pop("ep", request.id))
        return common_pb2.Empty()

    @rpc
    def CreateAllocator(self, request, context):
        client = self._client(context)
        info = self.state.memory_info(request.device_index, request.device_mem_type)
        allocator = self.state.factory.create_allocator(info, dict(request.options))
        return factory_pb2.CreateAllocatorResponse(allocator=client.add("allocator", allocator),
                                                   memory_info=MemoryInfo.to_proto(allocator.memory_info))

    @rpc
    def ReleaseAllocator(self, request, context):
        client = self._client(context)
        allocator = client.pop("allocator", request.id)
        for handle, entry in client.items("buffer"):
            if entry.allocator is allocator:
                client.pop("buffer", handle)
        self.state.factory.release_allocator(allocator)
        return common_pb2.Empty()

    @rpc
    def CreateDataTransfer(self, request, context):
        transfer = self.state.factory.create_data_transfer()
        handle = self._client(context).add("data_transfer", transfer) if transfer is not None else 0
        return factory_pb2.CreateDataTransferResponse(data_transfer=handle)

    @rpc
    def IsStreamAware(self, request, context):
        return factory_pb2.IsStreamAwareResponse(stream_aware=self.state.factory.is_stream_aware())

    @rpc
    def CreateSyncStreamForDevice(self, request, context):
        client = self._client(context)
        self.state.device(request.device_index)
        stream = self.state.factory.create_sync_stream_for_device(request.device_index, dict(request.options))
        return common_pb2.Handle(id=client.add("stream", stream))
