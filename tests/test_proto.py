"""The generated modules in ephost/v1 are what `make proto` makes from protos/ today."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_matches_protos(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos/ephost/v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"), f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos], check=True)
    generated = {p.name: p.read_bytes() for p in (tmp_path / "ephost/v1").iterdir()}
    committed = {p.name: p.read_bytes() for p in (ROOT / "ephost/v1").iterdir()
                 if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))}
    assert generated.keys() == committed.keys(), "run `make proto`: generated files differ in name"
    stale = sorted(name for name in generated if generated[name] != committed[name])
    assert not stale, f"run `make proto`: {stale} drifted from protos/"


def test_every_service_of_the_contract_is_served():
    from ephost.v1 import allocator_pb2, data_transfer_pb2, ep_pb2, factory_pb2, stream_pb2, worker_pb2
    services = {s.full_name: [m.name for m in s.methods]
                for mod in (allocator_pb2, data_transfer_pb2, ep_pb2, factory_pb2, stream_pb2, worker_pb2)
                for s in mod.DESCRIPTOR.services_by_name.values()}
    assert services["ephost.v1.EpFactory"] == [
        "GetInfo", "GetSupportedDevices", "CreateEp", "ReleaseEp", "CreateAllocator", "ReleaseAllocator",
        "CreateDataTransfer", "IsStreamAware", "CreateSyncStreamForDevice"]
    assert set(services["ephost.v1.Stream"]) == {"CreateNotification", "Activate", "WaitOnHost", "WaitOnDevice",
                                                 "Flush", "OnSessionRunEnd", "Release"}
    assert set(services["ephost.v1.DataTransfer"]) == {"CanCopy", "CopyTensors"}
    from ephost.server.main import SERVICES
    assert set(SERVICES) == set(services)
