"""ONNX's own node test cases through ephost (ephost.backend): every case ONNX's reference evaluator passes
in one process must pass through ephost, with the tolerances each case carries."""
import collections
import warnings

import pytest
from onnx.backend.test.runner import Runner
from onnx.reference import ReferenceEvaluator

import ephost
from ephost import backend
from ephost.eps.reference import evaluator_ops

from helpers import ALL_NODE_CASES, node_cases

# Each test runs some 1,700 cases: about a minute on a quiet 2-core machine, several on a loaded one.
pytestmark = pytest.mark.timeout(900)


def run_case(case, prepare, runs: int = 1) -> None:
    """`runs`: how often each data set is run (a session's later runs repeat its partitions' kept calls)."""
    rep = prepare(case.model)
    try:
        for inputs, expected in case.data_sets:
            for _ in range(runs):
                outputs = rep.run(inputs)
                Runner.assert_similar_outputs(expected, outputs, rtol=case.rtol, atol=case.atol, model_dir=None)
    finally:
        if hasattr(rep, "close"):
            rep.close()


class _InProcess:
    def __init__(self, model):
        self.evaluator = ReferenceEvaluator(model)
        self.names = [i.name for i in model.graph.input]

    def run(self, inputs):
        return self.evaluator.run(None, dict(zip(self.names, inputs)))


@pytest.fixture(scope="module")
def cases():
    """(all node cases, those the reference evaluator passes in one process)."""
    every = node_cases()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        passing = []
        for case in every:
            try:
                run_case(case, _InProcess)
            except Exception:
                continue
            passing.append(case)
    return every, passing


def through(env, providers, cases, fallback=None, options=None, runs: int = 1, kept: list | None = None):
    """`kept` gets the name of each model whose plan keeps a value where it was made for a later partition of the
    same EP (in a worker, or in process)."""
    failures, partitions = [], collections.Counter()
    if fallback is not None:
        options = options or ephost.SessionOptions()
        options.fallback = fallback

    def prepare(model):
        rep = backend.prepare(model, env=env, providers=providers, sess_options=options)
        partitions[len(rep.session.get_provider_graph_assignment_info())] += 1
        if kept is not None and any(p.keep for p in rep.session._runner.partitions):
            kept.append(model.graph.name)
        return rep

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in cases:
            try:
                run_case(case, prepare, runs)
            except Exception as e:
                failures.append(f"{case.name}: {type(e).__name__}: {str(e)[:300]}")
    return failures, partitions


def test_every_case_the_evaluator_passes_passes_on_a_reference_worker(cases):
    every, passing = cases
    assert len(every) > (1500 if ALL_NODE_CASES else 350) and len(passing) > 0.8 * len(every)
    with ephost.Environment() as env:
        env.register_execution_provider_library("worker", "reference")
        failures, partitions = through(env, ["worker"], passing)
    print(f"\nONNX node cases: {len(every)}; reference evaluator in process passes {len(passing)}; "
          f"through one reference worker: {len(passing) - len(failures)} pass")
    assert failures == [], "\n".join(failures[:20])
    assert set(partitions) <= {0, 1}, "a single worker that takes every op makes one partition"


def test_every_case_passes_split_across_two_workers_and_the_reference_fallback(cases):
    _, passing = cases
    ops = sorted(evaluator_ops())
    with ephost.Environment() as env:
        env.register_execution_provider_library("a", "reference", {"ops": ",".join(ops[0::3])})
        env.register_execution_provider_library("b", "reference", {"ops": ",".join(ops[1::3])})
        # Each data set three times: the later runs repeat kept calls, a plan with `keep` too
        kept = []
        failures, partitions = through(env, ["a", "b"], passing, fallback="reference", runs=3, kept=kept)
    multi = sum(n for k, n in partitions.items() if k > 1)
    print(f"\nsplit across two workers and the reference fallback: {len(passing) - len(failures)} of {len(passing)} "
          f"pass, each data set run three times; {multi} models ran as several partitions (up to "
          f"{max(partitions)}), {len(kept)} of them keeping a value where it was made for a later partition of its EP")
    assert failures == [], "\n".join(failures[:20])
    assert multi > 0.2 * len(passing), "most models that could be split ran as one partition"


class InProcessOrt:
    def __init__(self, model):
        import onnxruntime as ort
        from ephost.eps.onnxruntime import readable_model
        self.session = ort.InferenceSession(readable_model(model).SerializeToString(),
                                            providers=["CPUExecutionProvider"])
        self.names = [i.name for i in model.graph.input]

    def run(self, inputs):
        return self.session.run(None, dict(zip(self.names, inputs)))


@pytest.fixture(scope="module")
def ort_passing(cases):
    """The names of the node cases ONNX Runtime's CPU EP passes in process."""
    ort = pytest.importorskip("onnxruntime", reason="installed by the onnxruntime extra")
    every, _ = cases
    ort.set_default_logger_severity(4)
    names = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in every:
            try:
                run_case(case, InProcessOrt)
                names.add(case.name)
            except Exception:
                pass
    return names


def test_the_onnx_runtime_fallback_passes_what_ort_or_the_evaluator_passes(cases, ort_passing):
    """No EP at all: ORT's CPU EP in process takes what it runs, the reference evaluator the rest. A case
    fails only where ORT computes differently from ONNX's reference on a node it claims."""
    every, passing = cases
    with ephost.Environment() as env:
        failures, partitions = through(env, [], every, fallback="onnxruntime")
    failed = {f.split(":", 1)[0] for f in failures}
    passed = len(every) - len(failed)
    evaluator = {c.name for c in passing}
    print(f"\nwith the onnxruntime fallback alone {passed} of {len(every)} node cases pass (ORT in process "
          f"{len(ort_passing)}, the evaluator {len(evaluator)}, their union {len(ort_passing | evaluator)}); "
          f"{sum(n for k, n in partitions.items() if k > 1)} models ran split between ORT and the evaluator")
    regressions = sorted(ort_passing & failed)
    assert regressions == [], "\n".join(f for f in failures if f.split(":", 1)[0] in regressions)[:4000]
    assert passed > len(ort_passing)


# ep_failure_policy -> the cases of the whole suite that must pass at least (`make conformance`; bfloat16, float8
# and int4 reach ORT as OrtValues; under "fallback" the three cases ORT fails at run time on a node it claimed re-run
# on the fallback).
WORKER_TARGETS = {"raise": 1640, "fallback": 1643}


@pytest.mark.timeout(900)  # two passes over the suite through a worker: minutes on a loaded 2-core machine
@pytest.mark.parametrize("policy", list(WORKER_TARGETS))
def test_every_case_onnx_runtime_passes_in_process_passes_through_an_onnxruntime_worker(cases, ort_passing, policy):
    """The vendor decides: ONNX Runtime in the worker takes what it can run; the fallback takes the rest, so
    cases ORT cannot run alone pass as well."""
    every, _ = cases
    options = ephost.SessionOptions()
    options.ep_failure_policy = policy
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime")
        failures, _ = through(env, ["ort"], every, options=options)
    failed = {f.split(":", 1)[0] for f in failures}
    passed = len(every) - len(failed)
    print(f"\nONNX Runtime in process passes {len(ort_passing)} of {len(every)} node cases; through an onnxruntime "
          f"worker with the default fallback and ep_failure_policy={policy!r} {passed} pass")
    regressions = sorted(ort_passing & failed)
    assert regressions == [], "\n".join(f for f in failures if f.split(":", 1)[0] in regressions)[:4000]
    if ALL_NODE_CASES:
        assert passed >= WORKER_TARGETS[policy], "\n".join(failures)[:4000]
    assert passed > len(ort_passing), "the fallback takes what ORT cannot run: more cases pass than ORT alone"
