"""EP devices of a launched worker, of an in-process EP and of a worker started by hand."""
import json
import os
import stat
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import ephost
from ephost import DeviceMemoryType, HardwareDeviceType
from ephost.eps.reference import evaluator_ops


def test_launched_worker_reports_the_reference_device(ref_device):
    assert ref_device.ep_name == "reference"
    assert ref_device.ep_vendor == "ephost"
    assert ref_device.device.type == HardwareDeviceType.CPU
    assert ref_device.ep_metadata["ops"] == str(len(evaluator_ops()))
    default = ref_device.memory_info(DeviceMemoryType.DEFAULT)
    shared = ref_device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE)
    assert default.device_mem_type == DeviceMemoryType.DEFAULT and not default.host_accessible
    assert shared.device_mem_type == DeviceMemoryType.HOST_ACCESSIBLE and shared.host_accessible
    assert default != shared


def test_in_process_and_out_of_process_devices_agree(ref_device, local_device):
    assert (ref_device.ep_name, ref_device.ep_vendor, ref_device.device) == \
           (local_device.ep_name, local_device.ep_vendor, local_device.device)
    for t in DeviceMemoryType:
        remote, local = ref_device.memory_info(t), local_device.memory_info(t)
        # same memory, named for the registration that owns it
        assert remote.name.split(":", 1)[1] == local.name.split(":", 1)[1]
        assert remote.name != local.name


def test_ops_option_reaches_the_worker():
    with ephost.Environment() as env:
        env.register_execution_provider_library("few", "reference", {"ops": "Add,Relu"})
        (device,) = env.get_ep_devices()
        assert device.ep_metadata["ops"] == "2"
        assert device.ep_options == {"ops": "Add,Relu"}


def test_bad_ep_options_fail_registration_with_the_reason():
    with ephost.Environment() as env:
        with pytest.raises(ephost.EpInvalidArgument, match="NoSuchOp"):  # the worker's own refusal, typed
            env.register_execution_provider_library("bad", "reference", {"ops": "NoSuchOp"})
        with pytest.raises(ephost.EpInvalidArgument, match=r"unknown option\(s\) \['colour'\]"):
            env.register_execution_provider_library("bad", "reference", {"colour": "blue"})
        with pytest.raises(ephost.EpInvalidArgument, match="NoSuchOp"):
            env.register_execution_provider_library("bad", "inproc:reference", {"ops": "NoSuchOp"})
        with pytest.raises(ephost.EpNotFound, match="no EP named"):
            env.register_execution_provider_library("bad", "inproc:nonexistent")
        assert env.get_ep_devices() == []


def test_duplicate_and_unknown_registrations(env):
    with pytest.raises(ephost.EpAlreadyExists):
        env.register_execution_provider_library("ref", "reference")
    with pytest.raises(ephost.EpNotFound):
        env.unregister_execution_provider_library("never-registered")


def test_unregister_stops_the_worker():
    env = ephost.Environment()
    env.register_execution_provider_library("tmp", "reference")
    process = env.registration("tmp").process
    env.unregister_execution_provider_library("tmp")
    assert process.proc.poll() == 0, "worker should drain and exit cleanly"
    assert env.get_ep_devices() == []
    env.close()


def test_worker_announces_itself_and_reports_serving(worker):
    w = worker("--ep", "reference")
    ready = json.loads(w.ready_line)
    assert ready["ephost"] == "ready" and ready["ep"] == "reference" and ready["pid"] == w.proc.pid
    with grpc.insecure_channel(w.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "ephost.v1.Allocator", "ephost.v1.DataTransfer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_default_address_is_a_unix_socket_in_a_private_directory():
    proc = subprocess.Popen([sys.executable, "-m", "ephost", "worker", "--ep", "reference", "--exit-with-parent"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        address = json.loads(proc.stdout.readline())["address"]
        assert address.startswith("unix://")
        directory = os.path.dirname(address[len("unix://"):])
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        proc.stdin.close()
        proc.stdout.close()
    assert not os.path.exists(directory), "the worker removes its private directory when it exits"


def test_tcp_needs_insecure(worker):
    result = subprocess.run([sys.executable, "-m", "ephost", "worker", "--ep", "reference", "--listen",
                             "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--insecure" in result.stderr
    w = worker("--ep", "reference", "--listen", "127.0.0.1:0", "--insecure")
    host, port = w.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with ephost.Environment() as env:
        env.register_execution_provider_library("tcp", w.address)
        assert [d.ep_name for d in env.get_ep_devices()] == ["reference"]


def test_connect_to_a_running_worker_by_address(worker):
    w = worker("--ep", "reference", "--option", "ops=Add")
    with ephost.Environment() as env:
        env.register_execution_provider_library("remote", w.address)
        (device,) = env.get_ep_devices()
        assert device.ep_options == {"ops": "Add"}
    assert w.proc.poll() is None, "a worker the Environment did not launch is left running"
