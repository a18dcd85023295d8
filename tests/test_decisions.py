"""The pure decisions, without any worker: what a target names, the crash budget, the partition plan, the
feed checks."""
import os

import numpy as np
import pytest
from onnx import TensorProto, helper

import ephost
from ephost.client.crash_budget import CrashBudget
from ephost.client.feeds import check_feed, check_feed_names, shape_of, type_string
from ephost.client.planner import Claim, Placement, plan_partitions
from ephost.client.targets import parse_target
from ephost.eps.base import NodeGroup
from ephost.graph import GraphIndex
import models


@pytest.mark.parametrize("target, expected", [
    ("reference", ("launch", "reference", None, None, False)),
    ("inproc:reference", ("inproc", "reference", None, None, False)),
    ("unix:///run/w.sock", ("connect", None, "unix:///run/w.sock", None, False)),
    ("dns:///workers:50051", ("connect", None, "dns:///workers:50051", None, False)),
    ("grpc://host:50051", ("connect", None, "host:50051", None, False)),
    ("grpcs://host:50051", ("connect", None, "host:50051", None, True)),
    ("10.1.2.3:7000", ("connect", None, "10.1.2.3:7000", None, False)),
    ("[::1]:7000", ("connect", None, "[::1]:7000", None, False)),
    ("/opt/vendor/libnpu.so", ("launch", "onnxruntime", None, "/opt/vendor/libnpu.so", False)),
    ("libnpu.so", ("launch", "onnxruntime", None, os.path.abspath("libnpu.so"), False)),
])
def test_parse_target(target, expected):
    t = parse_target(target)
    assert (t.kind, t.ep, t.address, t.library, t.tls) == expected


def test_an_empty_target_is_refused():
    with pytest.raises(ephost.EpInvalidArgument, match="empty target"):
        parse_target("")


def test_crash_budget_backs_off_and_runs_out_within_its_window():
    budget = CrashBudget(limit=3, window_s=10, backoff_s=0.1, max_backoff_s=0.15)
    assert budget.record(0.0) == 0.1
    assert budget.record(1.0) == 0.15  # doubled, capped
    assert budget.record(2.0) is None  # the third within 10 s: spent
    fresh = CrashBudget(limit=3, window_s=10, backoff_s=0.1)
    assert fresh.record(0.0) == 0.1 and fresh.record(5.0) == 0.2
    assert fresh.record(20.0) == 0.1 and fresh.recent == 1  # the old crashes left the window


def _placement(name):
    return Placement(name, name.upper(), object())


def test_plan_puts_each_node_on_the_first_ep_that_claims_it_and_the_rest_on_the_fallback():
    index = GraphIndex.of(models.chain(["Relu", "Neg", "Abs"]))
    a, b, fallback = _placement("a"), _placement("b"), _placement("fallback")
    plan = plan_partitions(index, [Claim(a, [NodeGroup(("n0_Relu", "n1_Neg"), fused=True)]),
                                   Claim(b, [NodeGroup(("n1_Neg", "nope"), fused=True)])],
                          [Claim(fallback, [NodeGroup(("n2_Abs",), fused=True)])])
    assert [(p.registration, p.graph.nodes) for p in plan] == [("a", ("n0_Relu", "n1_Neg")),
                                                               ("fallback", ("n2_Abs",))]
    assert plan[0].graph.inputs == ("x",) and plan[1].graph.outputs == ("y",)


def test_plan_never_fuses_around_another_eps_node():
    """Add and Mul on one EP with Relu between them elsewhere: fused, they would form a cycle."""
    index = GraphIndex.of(models.diamond())
    a, b, fallback = _placement("a"), _placement("b"), _placement("fallback")
    plan = plan_partitions(index, [Claim(a, [NodeGroup(("add", "mul"), fused=True)]),
                                   Claim(b, [NodeGroup(("relu",), fused=True)])], [Claim(fallback, [])])
    assert [(p.registration, p.graph.nodes) for p in plan] == [("a", ("add",)), ("b", ("relu",)), ("a", ("mul",))]
    assert plan[0].keep == (0,), "s is read by a later partition of the same EP: it stays in the worker"
    assert plan[1].last_reads == () and plan[2].last_reads == ("s", "r")


def test_plan_gives_the_leftovers_to_the_first_fallback_that_claims_them():
    """ORT's CPU EP takes what it claimed of the leftovers; the reference evaluator only what ORT did not."""
    index = GraphIndex.of(models.chain(["Relu", "Neg", "Abs"]))
    a, ort, ref = _placement("a"), Placement("fallback", "CPUExecutionProvider", object()), \
        Placement("fallback", "reference", object())
    plan = plan_partitions(index, [Claim(a, [NodeGroup(("n0_Relu",), fused=True)])],
                           [Claim(ort, [NodeGroup(("n2_Abs",), fused=True)]),
                            Claim(ref, [NodeGroup(("n1_Neg", "n2_Abs"), fused=True)])])
    assert [(p.placement.ep_name, p.graph.nodes) for p in plan] == [
        ("A", ("n0_Relu",)), ("reference", ("n1_Neg",)), ("CPUExecutionProvider", ("n2_Abs",))]
    assert {p.registration for p in plan[1:]} == {"fallback"}


def test_plan_refuses_nodes_nobody_claimed_naming_them():
    index = GraphIndex.of(models.chain(["Relu", "Neg", "Abs"]))
    with pytest.raises(ephost.EpInvalidArgument, match=r"no EP takes node\(s\) n1_Neg, n2_Abs; .*fallback is None"):
        plan_partitions(index, [Claim(_placement("a"), [NodeGroup(("n0_Relu",), fused=True)])], [])


def test_feed_checks_are_onnx_runtimes():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "n"])
    assert type_string(x.type) == "tensor(float)" and shape_of(x.type) == [2, "n"]
    check_feed("x", x.type, np.zeros((2, 5), np.float32))
    with pytest.raises(ephost.EpInvalidArgument, match="expects tensor\\(float\\), got a float64"):
        check_feed("x", x.type, np.zeros((2, 5)))
    with pytest.raises(ephost.EpInvalidArgument, match="expects rank 2"):
        check_feed("x", x.type, np.zeros(2, np.float32))
    with pytest.raises(ephost.EpInvalidArgument, match="expects 2 along axis 0"):
        check_feed("x", x.type, np.zeros((3, 5), np.float32))
    with pytest.raises(ephost.EpInvalidArgument, match="must be a tensor"):
        check_feed("x", x.type, [1.0, 2.0])
    with pytest.raises(ephost.EpInvalidArgument, match="missing input"):
        check_feed_names({"x": x}, {}, {})
    with pytest.raises(ephost.EpInvalidArgument, match="unknown input name"):
        check_feed_names({"x": x}, {}, {"x": 1, "z": 2})
    check_feed_names({"x": x}, {"w": None}, {"x": 1, "w": 2})  # an initializer may be fed
