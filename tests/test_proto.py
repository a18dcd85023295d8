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


def test_every_method_of_every_service_is_served(worker):
    """Each RPC the protos declare, called with an empty request on a real worker, is answered by a handler:
    never UNIMPLEMENTED (a bad empty request may be refused, with another status)."""
    import grpc
    from google.protobuf import message_factory
    from ephost.server.main import SERVICES
    from ephost.v1 import allocator_pb2, data_transfer_pb2, ep_pb2, factory_pb2, stream_pb2, worker_pb2
    from helpers import RawClient

    services = [s for mod in (allocator_pb2, data_transfer_pb2, ep_pb2, factory_pb2, stream_pb2, worker_pb2)
                for s in mod.DESCRIPTOR.services_by_name.values()]
    assert {s.full_name for s in services} == set(SERVICES)
    methods = [(s, m) for s in services for m in s.methods]
    last = {"Goodbye": 1, "Shutdown": 2}  # these end the client and the worker: called after all the others
    methods.sort(key=lambda sm: last.get(sm[1].name, 0))
    served = worker("--ep", "reference")
    client = RawClient(served.address)
    try:
        answered = []
        for service, method in methods:
            request = message_factory.GetMessageClass(method.input_type)()
            reply = message_factory.GetMessageClass(method.output_type)
            path = f"/{service.full_name}/{method.name}"
            kind = ("stream_" if method.client_streaming else "unary_") + ("stream" if method.server_streaming
                                                                            else "unary")
            call = getattr(client.channel, kind)(path, request_serializer=type(request).SerializeToString,
                                                 response_deserializer=reply.FromString)
            try:
                result = call(iter([request]) if method.client_streaming else request, timeout=30,
                              metadata=client.metadata)
                if method.server_streaming:
                    list(result)
            except grpc.RpcError as e:
                assert e.code() != grpc.StatusCode.UNIMPLEMENTED, f"{path} is not served"
            answered.append(path)
        assert len(answered) == len(methods) > 40
    finally:
        client.close()
