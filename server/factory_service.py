"""EpFactory over gRPC (OrtEpFactory)."""
from __future__ import annotations

from ephost.types import MemoryInfo
from ephost.eps.arena import SIZE_OPTIONS as ARENA_SIZES
from ephost.server.rpc import Servicer, rpc
from ephost.v1 import common_pb2, factory_pb2


class EpFactoryService(Servicer):
    SERVICE = "ephost.v1.EpFactory"

    @rpc(client=False)
    def GetInfo(self, request, call):
        f = self.state.factory
        return factory_pb2.FactoryInfo(name=f.get_name(), vendor=f.get_vendor(), vendor_id=f.get_vendor_id(),
                                       version=f.get_version())

    @rpc(client=False)
    def GetSupportedDevices(self, request, call):
        return factory_pb2.SupportedDevices(devices=[d.to_proto() for d in self.state.devices])

    @rpc
    def CreateEp(self, request, call):
        client = call.client
        for i in request.device_indices:
            self.state.device(i)
        ep = self.state.factory.create_ep(list(request.device_indices), dict(request.session_options))
        return common_pb2.Handle(id=client.add("ep", ep))

    @rpc
    def ReleaseEp(self, request, call):
        client = call.client
        ep = client.pop("ep", request.id)
        # Its compiled partitions go with it: a Compute on one of them afterwards is NOT_FOUND.
        infos = [client.pop("compute_info", h)[1] for h, (owner, _) in client.items("compute_info") if owner is ep]
        if infos:
            ep.release_node_compute_infos(infos)
        self.state.factory.release_ep(ep)
        return common_pb2.Empty()

    @rpc
    def CreateAllocator(self, request, call):
        client = call.client
        info = self.state.memory_info(request.device_index, request.device_mem_type)
        options = dict(request.options)
        for key in ARENA_SIZES:
            if key in options and options[key].strip().isdigit():
                self.state.check_size(int(options[key]), f"allocator option {key}")
        allocator = self.state.factory.create_allocator(info, options)
        return factory_pb2.CreateAllocatorResponse(allocator=client.add("allocator", allocator),
                                                   memory_info=MemoryInfo.to_proto(allocator.memory_info))

    @rpc
    def ReleaseAllocator(self, request, call):
        client = call.client
        allocator = client.pop("allocator", request.id)
        for handle, entry in client.items("buffer"):
            if entry.allocator is allocator:
                client.pop("buffer", handle)
        self.state.release_allocator(allocator)
        return common_pb2.Empty()

    @rpc
    def CreateDataTransfer(self, request, call):
        transfer = self.state.factory.create_data_transfer()
        handle = call.client.add("data_transfer", transfer) if transfer is not None else 0
        return factory_pb2.CreateDataTransferResponse(data_transfer=handle)

    @rpc(client=False)
    def IsStreamAware(self, request, call):
        return factory_pb2.IsStreamAwareResponse(stream_aware=self.state.factory.is_stream_aware())

    @rpc
    def CreateSyncStreamForDevice(self, request, call):
        client = call.client
        self.state.device(request.device_index)
        stream = self.state.factory.create_sync_stream_for_device(request.device_index, dict(request.options))
        return common_pb2.Handle(id=client.add("stream", stream))
