"""providers= as ONNX Runtime code writes it, get_providers(), automatic EP selection by ORT's device policies and
delegates, and where a session reads its inputs and makes its outputs (get_input_memory_infos & co)."""
import numpy as np
import onnxruntime as ort
import pytest

import ephost
from ephost import HOST_MEMORY, InferenceSession, SessionOptions
import models


@pytest.fixture(scope="module")
def ort_env():
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("onnxruntime", "onnxruntime")
        environment.register_execution_provider_library("ref", "reference", {"ops": "Relu"})
        yield environment


def _registrations(session):
    return [s.registration for s in session.get_provider_graph_assignment_info()]


def test_the_usual_ort_pattern_runs_an_ep_then_the_cpu_fallback(ort_env):
    with InferenceSession(models.chain(["Relu", "Neg"]), env=ort_env,
                          providers=["onnxruntime", "CPUExecutionProvider"]) as session:
        assert _registrations(session) == ["onnxruntime"]
        assert session.get_providers() == ["CPUExecutionProvider"]  # its EP's name; the fallback's, once
        np.testing.assert_array_equal(session.run(None, {"x": np.array([-1, 2, -3, 4], np.float32)})[0],
                                      [0, -2, 0, -4])


def test_get_providers_lists_the_reference_evaluator_only_where_it_runs_something(ort_env):
    with InferenceSession(models.chain(["Relu", "Neg"]), env=ort_env, providers=["ref"]) as session:
        assert _registrations(session) == ["ref", "fallback"]
        assert session.get_providers() == ["reference", "CPUExecutionProvider"]  # the fallback's ORT runs Neg
    so = SessionOptions()
    so.fallback = "reference"
    with InferenceSession(models.chain(["Relu", "Neg"]), so, env=ort_env, providers=["ref"]) as session:
        assert session.get_providers() == ["reference"]


def test_an_ort_ep_name_runs_that_ep_in_a_worker_of_its_own(ort_env):
    so = SessionOptions()
    so.fallback = None  # CPUExecutionProvider is not the fallback then: ORT's CPU EP, out of process
    with InferenceSession(models.chain(["Relu"]), so, env=ort_env, providers=["CPUExecutionProvider"]) as session:
        assert _registrations(session) == ["CPUExecutionProvider"]
        assert ort_env.is_registered("CPUExecutionProvider")
        assert session.get_providers() == ["CPUExecutionProvider"]
    assert not ort_env.is_registered("CPUExecutionProvider")  # the session's own worker went with it


def test_a_worker_launched_for_sessions_serves_each_until_the_last_closes(ort_env):
    so = SessionOptions()
    so.fallback = None  # ORT's CPU EP out of process, in a worker launched for the sessions that name it
    x = np.array([-1, 2, -3, 4], np.float32)
    first = InferenceSession(models.chain(["Relu"]), so, env=ort_env, providers=["CPUExecutionProvider"])
    with InferenceSession(models.chain(["Neg"]), so, env=ort_env, providers=["CPUExecutionProvider"]) as second:
        first.close()
        assert ort_env.is_registered("CPUExecutionProvider")  # the second session still holds it
        np.testing.assert_array_equal(second.run(None, {"x": x})[0], -x)
        assert _registrations(second) == ["CPUExecutionProvider"]
    assert not ort_env.is_registered("CPUExecutionProvider")


def test_an_ort_ep_this_installation_lacks_is_left_out_with_orts_warning(ort_env):
    with pytest.warns(UserWarning, match="'CUDAExecutionProvider' is not in available provider names"):
        session = InferenceSession(models.chain(["Relu"]), env=ort_env,
                                   providers=[("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"])
    with session:
        assert _registrations(session) == ["fallback"]


def test_an_unknown_provider_is_refused_in_orts_words(ort_env):
    with pytest.raises(RuntimeError, match="Unknown Provider Type: InvalidProvider"):
        InferenceSession(models.chain(["Relu"]), env=ort_env, providers=["InvalidProvider"])
    with InferenceSession(models.chain(["Relu"]), env=ort_env, providers=["CPUExecutionProvider"]) as session:
        with pytest.raises(RuntimeError, match="Unknown Provider Type: InvalidProvider"):
            session.set_providers(["InvalidProvider"])
    with pytest.raises(ValueError, match="should be the same length"):
        InferenceSession(models.chain(["Relu"]), env=ort_env, providers=["ref"], provider_options=[{}, {}])


def test_a_device_policy_picks_the_sessions_eps(ort_env):
    so = SessionOptions()
    so.set_provider_selection_policy(ort.OrtExecutionProviderDevicePolicy.PREFER_GPU)  # no GPU here: CPU then
    with InferenceSession(models.chain(["Relu", "Neg"]), so, env=ort_env) as session:
        # ORT's order among CPU devices: not the default CPU EP first (ref's reference evaluator), ORT's CPU EP last
        assert _registrations(session) == ["ref", "onnxruntime"]
    with InferenceSession(models.chain(["Relu", "Neg"]), env=ort_env) as session:
        assert _registrations(session) == ["fallback"]  # no policy, no EP: the CPU fallback runs it all


def test_a_delegate_picks_the_sessions_eps_from_the_devices_and_the_models_metadata(ort_env):
    seen = {}

    def delegate(ep_devices, model_metadata, runtime_metadata, max_selections):
        seen.update(names=[d.ep_name for d in ep_devices], metadata=model_metadata, limit=max_selections)
        return [d for d in ep_devices if d.registration_name == "onnxruntime"]

    model = models.chain(["Relu", "Neg"])
    model.producer_name = "the-producer"
    so = SessionOptions()
    so.set_provider_selection_policy_delegate(delegate)
    with InferenceSession(model, so, env=ort_env) as session:
        assert _registrations(session) == ["onnxruntime"]
    assert seen["names"] == ["reference", "CPUExecutionProvider"] and seen["limit"] == 8
    assert seen["metadata"]["producer_name"] == "the-producer"
    so.set_provider_selection_policy_delegate(lambda *args: [])
    with pytest.raises(ephost.EpFailedPrecondition, match="did not select anything"):
        InferenceSession(model, so, env=ort_env)


def test_input_and_output_memory_is_where_the_eps_read_and_make_them(ort_env):
    with InferenceSession(models.chain(["Relu", "Neg"]), env=ort_env, providers=["ref"]) as session:
        (input_memory,) = session.get_input_memory_infos()
        (output_memory,) = session.get_output_memory_infos()
        (device,) = session.get_input_epdevices()
    assert input_memory.name.startswith("ref:") and input_memory.host_accessible  # ref reads x, in memory we map
    assert output_memory == HOST_MEMORY  # the fallback makes y
    assert device.registration_name == "ref"
    with InferenceSession(models.chain(["Neg"]), env=ort_env) as session:
        assert session.get_input_memory_infos() == [HOST_MEMORY] and session.get_input_epdevices() == [None]
