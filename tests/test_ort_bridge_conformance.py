"""ONNX's node test cases through ONNX Runtime with the bridge (ephost.ort) in front of its CPU EP: the bridged
EP (a worker hosting ORT's CPU EP) takes what the worker claims, ORT's own CPU EP the rest. No case ORT passes
alone may fail through the bridge."""
import warnings

import onnxruntime as ort
import pytest
from onnx.backend.test.runner import Runner

import ephost.ort
from ephost.eps.onnxruntime import readable_model

from helpers import node_cases


def run_case(case, options_of) -> set[str]:
    """Run one case; the EPs ORT assigned its nodes to."""
    model = readable_model(case.model)
    options = options_of()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    session = ort.InferenceSession(model.SerializeToString(), options)
    session.disable_fallback()  # an EP failure must fail the case, not rerun it on ORT's CPU EP alone
    names = [i.name for i in case.model.graph.input]
    for inputs, expected in case.data_sets:
        outputs = session.run(None, dict(zip(names, inputs)))
        Runner.assert_similar_outputs(expected, outputs, rtol=case.rtol, atol=case.atol, model_dir=None)
    return {s.ep_name for s in session.get_provider_graph_assignment_info()}


def alone() -> ort.SessionOptions:
    return ort.SessionOptions()


def bridged() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "bridged"], {})
    return options


def passing(cases, options_of) -> tuple[set[str], dict[str, str], set[str]]:
    """(cases that pass, failures, passing cases with a node on the bridged EP)."""
    names, failures, bridged_cases = set(), {}, set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in cases:
            try:
                eps = run_case(case, options_of)
                names.add(case.name)
                if "bridged" in eps:
                    bridged_cases.add(case.name)
            except Exception as e:  # noqa: BLE001
                failures[case.name] = f"{type(e).__name__}: {str(e)[:300]}"
    return names, failures, bridged_cases


@pytest.mark.timeout(1800)
def test_no_node_case_regresses_through_the_bridge():
    ort.set_default_logger_severity(4)
    every = node_cases()
    by_ort, _, _ = passing(every, alone)
    ephost.ort.register("bridged", "onnxruntime")
    try:
        by_bridge, failures, on_bridge = passing(every, bridged)
    finally:
        ephost.ort.unregister("bridged")
    print(f"\nONNX node cases: {len(every)}; ORT alone passes {len(by_ort)}; ORT with the bridge passes "
          f"{len(by_bridge)} ({len(by_bridge - by_ort)} more, {len(by_ort - by_bridge)} fewer), {len(on_bridge)} of "
          "them with nodes run in the worker")
    regressions = sorted(by_ort - by_bridge)
    assert regressions == [], "\n".join(f"{n}: {failures[n]}" for n in regressions[:30])
    assert len(on_bridge) > 0.9 * len(by_bridge)
