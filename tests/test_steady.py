"""A session's steady run (client/steady.py): a run made again as the last one went, straight to its partitions'
kept calls, and the general path wherever anything it was made with changed."""
from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import ephost
from ephost import InferenceSession, RunOptions
import models
from helpers import in_threads, options_for


def staged_model(rows="n"):
    """y = s @ x (a MatMul): x over the inline limit (staged in a buffer of the worker's) at 256 rows and more, s
    small (inline); `rows`: x's first dimension, symbolic by default."""
    return models.model([helper.make_node("MatMul", ["s", "x"], ["y"], name="mm")],
                        [models.tensor("s", [1, rows]), models.tensor("x", [rows, 1024])],
                        [models.tensor("y", [1, 1024])])


def feeds(rng, rows: int = 256) -> dict[str, np.ndarray]:
    return {"s": rng.standard_normal((1, rows)).astype(np.float32),
            "x": rng.standard_normal((rows, 1024)).astype(np.float32)}


def expected(f: dict[str, np.ndarray]) -> np.ndarray:
    return f["s"] @ f["x"]


class Computes:
    """Counts the Computes each partition of a session makes through its compute info (the general path's way
    to a worker; a steady run goes to the kept call it made, and to an in-process partition's compute info):
    `counts`, in the plan's order; `count`, the first's."""

    def __init__(self, session: InferenceSession):
        partitions = session._runner.partitions
        self.counts = [0] * len(partitions)
        self._lock = threading.Lock()  # threads' runs count too
        for i, partition in enumerate(partitions):
            partition.compute_info.compute = self._counted(i, partition.compute_info.compute)

    def _counted(self, i, compute):
        def counted(*args, **kwargs):
            with self._lock:
                self.counts[i] += 1
            return compute(*args, **kwargs)
        return counted

    @property
    def count(self) -> int:
        return self.counts[0]


@pytest.fixture(scope="module")
def env():
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ort", "onnxruntime", {"intra_op_num_threads": "1"})
        yield environment


def check(session, f, names=None) -> None:
    out = session.run(names, f)
    np.testing.assert_allclose(out[0], expected(f), rtol=1e-4, atol=1e-4)


def test_a_run_made_again_goes_straight_to_its_kept_call_and_gives_what_ort_gives(env):
    """The third run of a kind on a thread and the next go straight to the kept call the general path made
    (its inputs written into the buffers kept for it, no Compute through the partition's compute info), with
    every result as ORT's in process; `runs` counts them all."""
    rng = np.random.default_rng(1)
    model = staged_model(256)
    in_process = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with InferenceSession(model, options_for(env, "ort"), env=env) as s:
        computes = Computes(s)
        for _ in range(12):
            f = feeds(rng)
            (y,) = s.run(None, f)
            np.testing.assert_allclose(y, in_process.run(None, f)[0], rtol=1e-5, atol=1e-5)
            y[:] = 0  # the caller's own array: the next run's is another
        assert computes.count == 2, "runs after the second did not repeat the kept call straight"
        assert s.failure_counters["runs"] == 12


def test_a_steady_run_gives_way_to_the_general_path_where_the_run_differs(env):
    """Other shapes, other output names, a non-contiguous feed, run options, or feeds given as tensors: the
    general path, every result right; the steady run then serves the runs like its own again."""
    rng = np.random.default_rng(2)
    with InferenceSession(staged_model(), options_for(env, "ort"), env=env) as s:
        computes = Computes(s)
        for _ in range(3):
            check(s, feeds(rng))
        assert computes.count == 2
        differing = [
            (feeds(rng, 128), None, None),                                   # other shapes
            (feeds(rng), ["y"], None),                                       # output names given
            ({**feeds(rng), "x": np.asfortranarray(feeds(rng)["x"])}, None, None),  # not C-contiguous
            (feeds(rng), None, RunOptions(compute_timeout_s=30)),            # run options
            ({k: ephost.Tensor.from_numpy(v) for k, v in feeds(rng).items()}, None, None),  # tensors
        ]
        for f, names, options in differing:
            before = computes.count
            out = s.run(names, f, options)
            arrays = {k: v.numpy() if isinstance(v, ephost.Tensor) else v for k, v in f.items()}
            np.testing.assert_allclose(out[0], expected(arrays), rtol=1e-4, atol=1e-4)
            assert computes.count == before + 1, f"not the general path: {names}, {options}"
        before = computes.count
        check(s, feeds(rng))
        assert computes.count == before, "the steady run of the first kind did not serve it again"


def test_a_steady_run_whose_staging_buffers_were_outgrown_does_not_write_into_them(env):
    """A larger input of the same kind on the same thread replaces the staging buffers (the old ones given
    back, for others to use): the steady run made with them takes the general path, and every result is
    right."""
    rng = np.random.default_rng(3)
    with InferenceSession(staged_model(), options_for(env, "ort"), env=env) as s:
        computes = Computes(s)
        for _ in range(3):
            check(s, feeds(rng, 256))
        check(s, feeds(rng, 1024))  # 4 MiB: the buffer of 1 MiB is outgrown
        before = computes.count
        for _ in range(3):
            check(s, feeds(rng, 256))
        assert computes.count > before, "the steady run wrote into staging buffers it no longer held"


def test_steady_runs_are_each_threads_own(env):
    """Eight threads running one session: each makes its own steady run on its own lane connection, and every
    result is its own."""
    with InferenceSession(staged_model(), options_for(env, "ort"), env=env) as s:
        def work(seed):
            rng = np.random.default_rng(seed)
            for _ in range(20):
                check(s, feeds(rng, 64 + seed))

        assert in_threads(work, 8) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["raise", "retry", "fallback"])
def test_a_worker_that_dies_in_a_steady_run_is_answered_by_the_failure_policy(policy):
    """The worker's EP dies (a real SIGSEGV) in the Compute of a steady run: the run fails with EpWorkerCrashed
    naming the call (raise), or is made again on the restarted worker (retry) or on the CPU fallback (fallback),
    with the right result; the runs after it are right."""
    rng = np.random.default_rng(4)
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "chaos", {
            "wrap": "onnxruntime", "fault": "segfault", "at": "compute", "after": "4", "intra_op_num_threads": "1"})
        options = options_for(env, "w")
        options.ep_failure_policy = policy
        with InferenceSession(staged_model(), options, env=env) as s:
            computes = Computes(s)
            for _ in range(3):
                check(s, feeds(rng))
            assert computes.count == 2, "the third run was not a steady one"
            if policy == "raise":  # the 4th Compute, the second steady run's
                with pytest.raises(ephost.EpWorkerCrashed, match="Ep/Compute"):
                    s.run(None, feeds(rng))
            else:
                check(s, feeds(rng))
            # It was a steady run's: through the partition's compute info only as retried on the new worker
            assert computes.count == (3 if policy == "retry" else 2)
            assert env.registration("w").link.wait_healthy(10)
            for _ in range(2):  # (the new worker's 4th Compute would die too)
                check(s, feeds(rng))
            assert s.failure_counters["runs"] == 6


CHAIN = ["Relu", "Neg"] * 4


def chain_expected(x: np.ndarray, ops) -> np.ndarray:
    for op in ops:
        x = np.maximum(x, 0) if op == "Relu" else -x
    return x


@pytest.fixture(scope="module")
def workers():
    """Two reference workers, one taking Relu, the other Neg, and one taking NonZero and Cast."""
    with ephost.Environment() as environment:
        for name, ops in (("relu", "Relu"), ("neg", "Neg"), ("nz", "NonZero,Cast")):
            environment.register_execution_provider_library(name, "reference", {"ops": ops})
        yield environment


def test_a_plan_of_partitions_in_two_workers_is_made_again_step_by_step(workers):
    """A chain alternating between two workers (8 partitions): from the third run on, each partition's kept
    call is made again straight, the next reading the last one's outputs, and every result is right."""
    rng = np.random.default_rng(5)
    with InferenceSession(models.chain(CHAIN), options_for(workers, "relu", "neg"), env=workers) as s:
        assert len(s.get_provider_graph_assignment_info()) == len(CHAIN)
        computes = Computes(s)
        for _ in range(6):
            x = rng.standard_normal(4).astype(np.float32)
            (y,) = s.run(None, {"x": x})
            np.testing.assert_array_equal(y, chain_expected(x, CHAIN))
        assert computes.counts == [2] * len(CHAIN), "runs after the second went the general path"
        assert s.failure_counters["runs"] == 6


def test_a_steady_run_makes_partitions_in_process_again_between_those_in_a_worker(workers):
    """A worker taking Relu, the CPU fallback (in this process) the Neg nodes between: the steady run goes
    straight to the worker's kept calls and to the fallback's compute, and every result is right."""
    rng = np.random.default_rng(6)
    with InferenceSession(models.chain(CHAIN), options_for(workers, "relu"), env=workers) as s:
        assigned = [a.ep_name for a in s.get_provider_graph_assignment_info()]
        assert assigned[1] != assigned[0] and len(assigned) == len(CHAIN), assigned
        computes = Computes(s)
        for _ in range(6):
            x = rng.standard_normal(4).astype(np.float32)
            (y,) = s.run(None, {"x": x})
            np.testing.assert_array_equal(y, chain_expected(x, CHAIN))
        assert computes.counts[0::2] == [2] * 4, "the worker's partitions went the general path"
        assert computes.counts[1::2] == [6] * 4


def nonzero_model():
    """x -> Relu (worker) -> NonZero, Cast (another) -> Neg (a third): y's length is the count of x's positive
    elements, known only as the middle partition runs."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("NonZero", ["r"], ["i"], name="nonzero"),
             helper.make_node("Cast", ["i"], ["c"], name="cast", to=1),
             helper.make_node("Neg", ["c"], ["y"], name="neg")]
    return models.model(nodes, [models.tensor("x", [6])], [models.tensor("y", [1, "n"])])


def test_a_step_whose_outputs_change_shape_hands_the_rest_of_the_run_to_the_general_path(workers):
    """The middle partition's output takes another shape (as many positions as x has positive elements): the
    steady run stops there and the general path runs the rest with what it made; every result is right. The
    worker answers that call whole while its outputs are not of the shape it was kept with, so runs of the new
    shape make no steady run; runs of the first shape make one again."""
    with InferenceSession(nonzero_model(), options_for(workers, "relu", "nz", "neg"), env=workers) as s:
        assert [a.registration for a in s.get_provider_graph_assignment_info()] == ["relu", "nz", "neg"]
        computes = Computes(s)
        two = np.array([1, -1, 2, -2, -3, -4], np.float32)
        three = np.array([1, -1, 2, -2, 3, -4], np.float32)

        def run(x):
            (y,) = s.run(None, {"x": x})
            np.testing.assert_array_equal(y, -np.flatnonzero(x > 0).astype(np.float32)[None, :])

        for _ in range(3):
            run(two)
        assert computes.counts == [2, 2, 2]
        run(three)  # the steady run's: its middle step came back whole, the last partition went the general way
        assert computes.counts == [2, 2, 3]
        for _ in range(4):
            run(three)
        assert computes.counts == [6, 6, 7]
        for _ in range(4):  # the first of them (feeds as the run before) makes a steady run again
            run(two)
        assert computes.counts == [7, 7, 8], "runs of the first shape made no steady run again"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["raise", "retry", "fallback"])
def test_a_worker_that_dies_in_a_middle_step_is_answered_by_the_failure_policy(policy):
    """The worker of a chain's middle partitions dies (a real SIGSEGV) in a steady run: the run fails with
    EpWorkerCrashed (raise), or the partition is made again on the restarted worker (retry) or on the CPU
    fallback (fallback) and the rest of the run goes the general path, with the right result; the runs after
    it are right."""
    rng = np.random.default_rng(7)
    ops = ["Relu", "Neg", "Relu"]
    with ephost.Environment() as env:
        env.register_execution_provider_library("relu", "reference", {"ops": "Relu"})
        env.register_execution_provider_library("neg", "chaos", {
            "wrap": "reference", "ops": "Neg", "fault": "segfault", "at": "compute", "after": "4"})
        options = options_for(env, "relu", "neg")
        options.ep_failure_policy = policy
        with InferenceSession(models.chain(ops), options, env=env) as s:
            computes = Computes(s)

            def run():
                x = rng.standard_normal(4).astype(np.float32)
                (y,) = s.run(None, {"x": x})
                np.testing.assert_array_equal(y, chain_expected(x, ops))

            for _ in range(3):
                run()
            assert computes.counts == [2, 2, 2], "the third run was not a steady one"
            if policy == "raise":  # the middle partition's 4th Compute, the second steady run's
                with pytest.raises(ephost.EpWorkerCrashed, match="Ep/Compute"):
                    s.run(None, {"x": rng.standard_normal(4).astype(np.float32)})
            else:
                run()
            # The first step was steady; the middle one through its compute info only as retried on the new
            # worker; the last through the general path where the run went on
            assert computes.counts == [2, 3 if policy == "retry" else 2, 2 if policy == "raise" else 3]
            assert env.registration("neg").link.wait_healthy(10)
            for _ in range(2):
                run()
            assert s.failure_counters["runs"] == 6


def test_eight_threads_run_one_chain_each_with_its_own_steady_run(workers):
    """Eight threads running one session whose chain alternates between two workers: each thread's steady run
    goes on its own lane connections, and every result is its own."""
    with InferenceSession(models.chain(CHAIN), options_for(workers, "relu", "neg"), env=workers) as s:
        computes = Computes(s)

        def work(seed):
            rng = np.random.default_rng(seed)
            for _ in range(20):
                x = rng.standard_normal(4).astype(np.float32)
                (y,) = s.run(None, {"x": x})
                np.testing.assert_array_equal(y, chain_expected(x, CHAIN))

        assert in_threads(work, 8) == []
        assert computes.counts == [16] * len(CHAIN), "the threads' runs after their second were not steady"
