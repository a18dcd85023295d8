"""Sessions over kept calls (client/remote.py, client/fastlane.py): every run goes one path, and the transport
repeats each partition's Compute as the call its worker keeps, sending only what changes (its inputs'
dimensions and bytes, the handles of the buffers it names), whatever the inputs' shapes. What each worker served
is read from its counters: `kept_calls` (repeats) and `calls_kept` (new calls it kept)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ephost
from ephost import InferenceSession, RunOptions
import models
from helpers import in_threads, options_for, worker_stats


def staged_model(rows="n"):
    """y = s @ x (a MatMul): x over the inline limit (staged in a buffer of the worker's) at 128 rows and more, s
    small (inline); `rows`: x's first dimension, symbolic by default."""
    return models.model([helper.make_node("MatMul", ["s", "x"], ["y"], name="mm")],
                        [models.tensor("s", [1, rows]), models.tensor("x", [rows, 1024])],
                        [models.tensor("y", [1, 1024])])


def feeds(rng, rows: int = 256) -> dict[str, np.ndarray]:
    return {"s": rng.standard_normal((1, rows)).astype(np.float32),
            "x": rng.standard_normal((rows, 1024)).astype(np.float32)}


def expected(f: dict[str, np.ndarray]) -> np.ndarray:
    return f["s"] @ f["x"]


class Calls:
    """What the workers of these registrations served since this was made: the kept calls' repeats (only what
    changed sent) and the new calls they kept."""

    def __init__(self, env, *names: str):
        self._env, self._names = env, names
        self._start = {name: self._read(name) for name in names}

    def _read(self, name: str) -> tuple[int, int]:
        stats = self._env.get_worker_stats(name)
        return stats.kept_calls, stats.calls_kept

    def repeats(self, name: str | None = None) -> int:
        return sum(self._read(n)[0] - self._start[n][0] for n in ([name] if name else self._names))

    def kept(self, name: str | None = None) -> int:
        return sum(self._read(n)[1] - self._start[n][1] for n in ([name] if name else self._names))


@pytest.fixture(scope="module")
def env():
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ort", "onnxruntime", {"intra_op_num_threads": "1"})
        environment.register_execution_provider_library("ort_socket", "onnxruntime", {"intra_op_num_threads": "1",
                                                                                      "fast_lane_slots": "false"})
        yield environment


def check(session, f, names=None) -> None:
    out = session.run(names, f)
    np.testing.assert_allclose(out[0], expected(f), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("registration", ["ort", "ort_socket"])
@pytest.mark.parametrize("rows", [256, 32])
def test_runs_after_the_first_repeat_the_kept_call_and_give_what_ort_gives(env, registration, rows):
    """The first run's Compute is kept by the worker; every later run repeats it (its large input written into
    the buffer kept for it), with every result as ORT's in process; `runs` counts them all. So too where the
    repeat's frame goes on the socket: without slots (`fast_lane_slots=false`), and with slots where it is longer
    than a packet (32 rows: x inline, 128 KiB)."""
    rng = np.random.default_rng(1)
    model = staged_model(rows)
    in_process = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with InferenceSession(model, options_for(env, registration), env=env) as s:
        calls = Calls(env, registration)
        for _ in range(12):
            f = feeds(rng, rows)
            (y,) = s.run(None, f)
            np.testing.assert_allclose(y, in_process.run(None, f)[0], rtol=1e-5, atol=1e-5)
            y[:] = 0  # the caller's own array: the next run's is another
        assert (calls.kept(), calls.repeats()) == (1, 11)
        assert s.failure_counters["runs"] == 12


def test_runs_that_differ_but_in_how_their_inputs_travel_repeat_one_kept_call(env):
    """Other shapes, other output names, a non-contiguous feed, a deadline of their own, or feeds given as
    tensors: the same partition, inputs of the same types and ranks going the same way, so the same kept call,
    every result right. Run options an EP reads go whole (a repeat carries none), and the kept call serves the
    next run."""
    rng = np.random.default_rng(2)
    with InferenceSession(staged_model(), options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")
        for _ in range(3):
            check(s, feeds(rng))
        differing = [
            (feeds(rng, 128), None, None),                                   # other shapes
            (feeds(rng), ["y"], None),                                       # output names given
            ({**feeds(rng), "x": np.asfortranarray(feeds(rng)["x"])}, None, None),  # not C-contiguous
            (feeds(rng), None, RunOptions(compute_timeout_s=30)),            # a deadline of its own
            ({k: ephost.Tensor.from_numpy(v) for k, v in feeds(rng).items()}, None, None),  # tensors
        ]
        for f, names, options in differing:
            out = s.run(names, f, options)
            arrays = {k: v.numpy() if isinstance(v, ephost.Tensor) else v for k, v in f.items()}
            np.testing.assert_allclose(out[0], expected(arrays), rtol=1e-4, atol=1e-4)
        assert (calls.kept(), calls.repeats()) == (1, 2 + len(differing))
        with_entries = RunOptions()
        with_entries.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        f = feeds(rng)
        np.testing.assert_allclose(s.run(None, f, with_entries)[0], expected(f), rtol=1e-4, atol=1e-4)
        check(s, feeds(rng))
        assert (calls.kept(), calls.repeats()) == (1, 3 + len(differing))


def test_a_kept_call_whose_staging_buffers_were_outgrown_names_the_new_ones(env):
    """A larger input of the same kind on the same thread replaces the staging buffers (the old ones given back,
    for others to use): the repeats name the new ones, and every result is right."""
    rng = np.random.default_rng(3)
    with InferenceSession(staged_model(), options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")
        for _ in range(3):
            check(s, feeds(rng, 256))
        check(s, feeds(rng, 1024))  # 4 MiB: the buffer of 1 MiB is outgrown
        for _ in range(3):
            check(s, feeds(rng, 256))
        assert (calls.kept(), calls.repeats()) == (1, 6)


def test_kept_calls_are_each_threads_own(env):
    """Eight threads running one session: each repeats a call kept on its own lane connection, and every result
    is its own."""
    with InferenceSession(staged_model(), options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")

        def work(seed):
            rng = np.random.default_rng(seed)
            for _ in range(20):
                check(s, feeds(rng, 64 + seed))

        assert in_threads(work, 8) == []
        assert (calls.kept(), calls.repeats()) == (8, 8 * 19)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["raise", "retry", "fallback"])
def test_a_worker_that_dies_in_a_repeat_is_answered_by_the_failure_policy(policy):
    """The worker's EP dies (a real SIGSEGV) in the Compute of a kept call's repeat: the run fails with
    EpWorkerCrashed naming the call (raise), or is made again on the restarted worker (retry) or on the CPU
    fallback (fallback), with the right result; the runs after it are right, and repeat a call the new worker
    keeps."""
    rng = np.random.default_rng(4)
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "chaos", {
            "wrap": "onnxruntime", "fault": "segfault", "at": "compute", "after": "4", "intra_op_num_threads": "1"})
        options = options_for(env, "w")
        options.ep_failure_policy = policy
        with InferenceSession(staged_model(), options, env=env) as s:
            calls = Calls(env, "w")
            for _ in range(3):
                check(s, feeds(rng))
            assert (calls.kept(), calls.repeats()) == (1, 2)
            if policy == "raise":  # the 4th Compute
                with pytest.raises(ephost.EpWorkerCrashed, match="Ep/Compute"):
                    s.run(None, feeds(rng))
            else:
                check(s, feeds(rng))
            assert env.registration("w").link.wait_healthy(10)
            for _ in range(2):  # (the new worker's 4th Compute would die too)
                check(s, feeds(rng))
            stats = worker_stats(env, "w")  # the new worker's: the retried call, then the two runs
            assert (stats.calls_kept, stats.kept_calls) == (1, 2 if policy == "retry" else 1)
            assert s.failure_counters["runs"] == 6


@pytest.mark.timeout(60)
def test_a_worker_that_dies_as_a_run_allocates_its_staging_buffer_is_answered_by_the_failure_policy():
    """The worker's EP dies (a real SIGSEGV) in the Alloc of a run's staging buffer (a larger input outgrew the
    thread's): the run is made again on the restarted worker (retry), with the right result, as are the runs
    after it."""
    import signal
    rng = np.random.default_rng(5)
    with ephost.Environment() as env:
        # The worker's first Alloc is the first run's staging buffer; it dies in its second
        env.register_execution_provider_library("w", "chaos", {
            "wrap": "onnxruntime", "fault": "segfault", "at": "alloc", "after": "2", "intra_op_num_threads": "1"})
        options = options_for(env, "w")
        options.ep_failure_policy = "retry"
        with InferenceSession(staged_model(), options, env=env) as s:
            check(s, feeds(rng, 256))
            dead = env.registration("w").process
            check(s, feeds(rng, 512))  # its staging buffer outgrown: the worker dies in the new one's Alloc
            assert dead.exited.wait(5) and dead.returncode == -signal.SIGSEGV
            for _ in range(3):
                check(s, feeds(rng, 256))
            assert s.failure_counters["retried"] == 1


CHAIN = ["Relu", "Neg"] * 4


def chain_expected(x: np.ndarray, ops) -> np.ndarray:
    for op in ops:
        x = np.maximum(x, 0) if op == "Relu" else -x
    return x


def dying_worker(env, policy: str, dying: tuple[str, str], after: int, other: tuple[str, str]):
    """SessionOptions under `policy` for two reference workers registered in `env` (name, ops): `dying`, whose EP
    dies (a real SIGSEGV) in its `after`th Compute, and `other`."""
    env.register_execution_provider_library(other[0], "reference", {"ops": other[1]})
    env.register_execution_provider_library(dying[0], "chaos", {
        "wrap": "reference", "ops": dying[1], "fault": "segfault", "at": "compute", "after": str(after)})
    options = options_for(env, dying[0], other[0])
    options.ep_failure_policy = policy
    return options


@pytest.fixture(scope="module")
def workers():
    """Reference workers: one taking Relu, one Neg, one NonZero and Cast, and one Add and Mul."""
    with ephost.Environment() as environment:
        for name, ops in (("relu", "Relu"), ("neg", "Neg"), ("nz", "NonZero,Cast"), ("am", "Add,Mul")):
            environment.register_execution_provider_library(name, "reference", {"ops": ops})
        yield environment


def test_a_plan_of_partitions_in_two_workers_repeats_each_partitions_kept_call(workers):
    """A chain alternating between two workers (8 partitions): from the second run on, each partition's kept
    call is repeated, the next reading the last one's outputs, and every result is right."""
    rng = np.random.default_rng(5)
    with InferenceSession(models.chain(CHAIN), options_for(workers, "relu", "neg"), env=workers) as s:
        assert len(s.get_provider_graph_assignment_info()) == len(CHAIN)
        calls = Calls(workers, "relu", "neg")
        for _ in range(6):
            x = rng.standard_normal(4).astype(np.float32)
            (y,) = s.run(None, {"x": x})
            np.testing.assert_array_equal(y, chain_expected(x, CHAIN))
        for name in ("relu", "neg"):
            assert (calls.kept(name), calls.repeats(name)) == (4, 4 * 5)
        assert s.failure_counters["runs"] == 6


def test_a_partition_whose_call_its_connection_has_no_room_to_keep_goes_whole():
    """Four partitions in each of two workers whose connections keep three calls each: the three kept are
    repeated run after run, the fourth goes whole every run (none of the three makes room for it: each was used
    since), and every result is right."""
    rng = np.random.default_rng(7)
    with ephost.Environment() as env:
        for name, op in (("relu", "Relu"), ("neg", "Neg")):
            env.register_execution_provider_library(name, "reference", {"ops": op, "kept_calls_max": "3"})
        with InferenceSession(models.chain(CHAIN), options_for(env, "relu", "neg"), env=env) as s:
            calls = Calls(env, "relu", "neg")
            for _ in range(6):
                x = rng.standard_normal(4).astype(np.float32)
                (y,) = s.run(None, {"x": x})
                np.testing.assert_array_equal(y, chain_expected(x, CHAIN))
            for name in ("relu", "neg"):
                assert (calls.kept(name), calls.repeats(name)) == (3, 3 * 5)
                assert worker_stats(env, name).methods["Ep/Compute"].calls == 4 * 6


def test_partitions_in_process_between_those_in_a_worker(workers):
    """A worker taking Relu, the CPU fallback (in this process) the Neg nodes between: the worker's partitions
    repeat their kept calls, and every result is right."""
    rng = np.random.default_rng(6)
    with InferenceSession(models.chain(CHAIN), options_for(workers, "relu"), env=workers) as s:
        assigned = [a.ep_name for a in s.get_provider_graph_assignment_info()]
        assert assigned[1] != assigned[0] and len(assigned) == len(CHAIN), assigned
        calls = Calls(workers, "relu")
        for _ in range(6):
            x = rng.standard_normal(4).astype(np.float32)
            (y,) = s.run(None, {"x": x})
            np.testing.assert_array_equal(y, chain_expected(x, CHAIN))
        assert (calls.kept(), calls.repeats()) == (4, 4 * 5)


def kept_model():
    """models.diamond with its sum an output too: x -> Add -> s; s -> Relu -> r; (s, r) -> Mul -> y. With Add and
    Mul in one worker, s is kept there for the Mul (the plan's `keep`) and read by the Relu's partition too."""
    nodes = [helper.make_node("Add", ["x", "x"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("Mul", ["s", "r"], ["y"], name="mul")]
    return models.model(nodes, [models.tensor("x", [2, 3])], [models.tensor("y", [2, 3]), models.tensor("s", [2, 3])])


@pytest.mark.parametrize("relu", ["relu", None])
def test_a_value_a_worker_keeps_for_a_later_partition_there_is_named_by_handle(workers, relu):
    """A worker's two partitions with another's (or the CPU fallback's, in this process) between them, the first
    leaving the sum in its worker for the second (the plan's `keep`): each partition's call is repeated, the
    second naming the sum by handle in the worker, the Relu reading it through this process's mapping (or as it
    is, in process), and every result is right. The sum, an output too, comes back as an array that stays right
    after later runs; the buffers the runs left in the worker are freed."""
    rng = np.random.default_rng(8)
    names = ("am", relu) if relu else ("am",)
    with InferenceSession(kept_model(), options_for(workers, *names), env=workers) as s:
        partitions = s._runner.partitions
        assert [p.registration for p in partitions][0::2] == ["am", "am"] and partitions[0].keep == (0,)
        calls = Calls(workers, *names)
        before = worker_stats(workers, "am")
        kept = []

        def run(keep: bool) -> None:
            x = rng.standard_normal((2, 3)).astype(np.float32)
            y, total = s.run(None, {"x": x})
            np.testing.assert_allclose(y, models.diamond_expected(x), rtol=1e-6)
            np.testing.assert_array_equal(total, x + x)
            if keep:
                kept.append((x, total))

        for _ in range(8):
            run(True)
        assert (calls.kept("am"), calls.repeats("am")) == (2, 2 * 7)
        if relu:
            assert (calls.kept("relu"), calls.repeats("relu")) == (1, 7)
        assert partitions[0].allocator.flush_frees()
        for _ in range(4):  # in memory freed by now, were the sums not held
            run(False)
        for x, total in kept:  # the sums handed out are the application's, whatever ran since
            np.testing.assert_array_equal(total, x + x)
        after = worker_stats(workers, "am")
        assert after.compute_inputs_resident - before.compute_inputs_resident == 12, "the sum was not named there"
        del kept[:], total  # (the loop's last sum holds its tensor too)
        assert partitions[0].allocator.flush_frees()
        assert worker_stats(workers, "am").buffers_live == before.buffers_live


def test_a_value_kept_in_process_is_read_by_a_worker_between(workers):
    """The other way round: Add and Mul on the CPU fallback in this process, the sum kept there for the Mul, and
    the Relu between them in a worker, which reads the sum from this process: the worker's call is repeated, and
    every result is right."""
    rng = np.random.default_rng(11)
    with InferenceSession(models.diamond(), options_for(workers, "relu"), env=workers) as s:
        partitions = s._runner.partitions
        assert [p.registration for p in partitions][1] == "relu" and partitions[0].keep == (0,)
        calls = Calls(workers, "relu")
        for _ in range(6):
            x = rng.standard_normal((2, 3)).astype(np.float32)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
        assert (calls.kept(), calls.repeats()) == (1, 5)


@pytest.mark.parametrize("relu", ["relu", None])
def test_a_kept_value_the_run_does_not_hand_out_stays_in_the_worker(workers, relu):
    """The same plan, the sum not asked for: it stays in the worker for the second partition, which names it by
    handle; it is written into a tensor of the worker's that the run's plan holds (its shape is known before the
    run), the same every run: no run after the first leaves a buffer in the worker or frees one, nothing of it
    comes to the application, and every result is right."""
    rng = np.random.default_rng(10)
    names = ("am", relu) if relu else ("am",)
    with InferenceSession(models.diamond(), options_for(workers, *names), env=workers) as s:
        partitions = s._runner.partitions
        assert partitions[0].keep == (0,) and partitions[2].registration == "am"
        calls = Calls(workers, "am")

        def run() -> None:
            x = rng.standard_normal((2, 3)).astype(np.float32)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)

        for _ in range(3):
            run()
        assert partitions[0].allocator.flush_frees()
        before = worker_stats(workers, "am")
        for _ in range(10):
            run()
        assert partitions[0].allocator.flush_frees()
        after = worker_stats(workers, "am")
        assert (calls.kept(), calls.repeats()) == (2, 2 * 12)
        assert after.compute_inputs_resident - before.compute_inputs_resident == 10
        assert after.buffers_live == before.buffers_live
        assert after.methods["Allocator/Free"].calls == before.methods["Allocator/Free"].calls, \
            "the runs left buffers in the worker, freed since"


LARGE = (1, 1 << 17)  # 512 KiB of floats: not under the inline limit, so a worker leaves them in its memory


@pytest.mark.parametrize("names", [("relu", "neg"), ("relu",)])
def test_values_too_large_to_come_back_inline_are_handed_over_by_a_kept_calls_record(workers, names):
    """A Relu then a Neg on 512 KiB, each output left in a new buffer of its worker's (too large for the reply):
    a kept call's repeat hands such an output over by its PLACED record, as one `keep` names. The Neg's worker (or
    the CPU fallback, in this process) reads the Relu's output through this process's mapping, the application
    gets the Neg's as an array of its own, every result right after later runs too; the buffers go back to the
    workers once the arrays go."""
    rng = np.random.default_rng(12)
    ops = ["Relu", "Neg"]
    with InferenceSession(models.chain(ops, shape=LARGE), options_for(workers, *names), env=workers) as s:
        partitions = s._runner.partitions
        assert not any(p.keep for p in partitions)
        before = {name: worker_stats(workers, name) for name in names}
        runs = []
        for _ in range(6):
            x = rng.standard_normal(LARGE).astype(np.float32)
            (y,) = s.run(None, {"x": x})
            assert type(y) is np.ndarray
            np.testing.assert_array_equal(y, chain_expected(x, ops))
            runs.append((x, y))
        for x, y in runs:  # each run's output its own, whatever ran since
            np.testing.assert_array_equal(y, chain_expected(x, ops))
        for name in names:
            after = worker_stats(workers, name)
            assert after.kept_calls - before[name].kept_calls == 5
            assert after.compute_outputs_copied - before[name].compute_outputs_copied == 6  # into new buffers
        del runs, y
        for p in partitions:
            if p.allocator is not None:
                assert p.allocator.flush_frees()
        # Left in each worker: the buffer this thread keeps for its partition's input (staged, as large)
        for name in names:
            assert worker_stats(workers, name).buffers_live == before[name].buffers_live + 1


def test_an_ort_output_too_large_to_come_back_inline_is_written_where_a_kept_call_leaves_it(env):
    """ORT's CPU EP in a worker writes a 1 MiB output straight into a new buffer of the call's allocator (no
    copy), and the call is still kept: runs after the first repeat it, every result right."""
    rng = np.random.default_rng(13)
    shape = (1, 1 << 18)
    with InferenceSession(models.chain(["Relu"], shape=shape), options_for(env, "ort"), env=env) as s:
        before = worker_stats(env, "ort")
        for _ in range(5):
            x = rng.standard_normal(shape).astype(np.float32)
            (y,) = s.run(None, {"x": x})
            np.testing.assert_array_equal(y, np.maximum(x, 0))
        after = worker_stats(env, "ort")
        assert after.kept_calls - before.kept_calls == 4
        assert after.compute_outputs_in_place - before.compute_outputs_in_place == 5
        assert after.compute_outputs_copied == before.compute_outputs_copied


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["raise", "retry", "fallback"])
@pytest.mark.parametrize("handed_out", [True, False])
def test_a_worker_that_dies_holding_a_kept_value_is_answered_by_the_failure_policy(policy, handed_out):
    """The worker keeping the sum for its second partition dies (a real SIGSEGV) at that partition: the run fails
    with EpWorkerCrashed (raise), or the partition is made again on the restarted worker (retry) or on the CPU
    fallback (fallback) from the sum its predecessor left, and the run is right, as are the runs after it."""
    rng = np.random.default_rng(9)
    with ephost.Environment() as env:
        # Its computes: two a run (Add, then Mul); the 8th is the fourth run's Mul
        options = dying_worker(env, policy, ("am", "Add,Mul"), 8, ("relu", "Relu"))
        with InferenceSession(kept_model() if handed_out else models.diamond(), options, env=env) as s:
            def run():
                x = rng.standard_normal((2, 3)).astype(np.float32)
                out = s.run(None, {"x": x})
                np.testing.assert_allclose(out[0], models.diamond_expected(x), rtol=1e-6)
                if handed_out:
                    np.testing.assert_array_equal(out[1], x + x)

            for _ in range(3):
                run()
            if policy == "raise":
                with pytest.raises(ephost.EpWorkerCrashed, match="Ep/Compute"):
                    s.run(None, {"x": rng.standard_normal((2, 3)).astype(np.float32)})
            else:
                run()
            assert env.registration("am").link.wait_healthy(10)
            for _ in range(3):
                run()
            assert s.failure_counters["runs"] == 7


def nonzero_model():
    """x -> Relu (worker) -> NonZero, Cast (another) -> Neg (a third): y's length is the count of x's positive
    elements, known only as the middle partition runs."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("NonZero", ["r"], ["i"], name="nonzero"),
             helper.make_node("Cast", ["i"], ["c"], name="cast", to=1),
             helper.make_node("Neg", ["c"], ["y"], name="neg")]
    return models.model(nodes, [models.tensor("x", [6])], [models.tensor("y", [1, "n"])])


def test_outputs_whose_shape_is_known_only_as_a_partition_runs_repeat_the_kept_calls(workers):
    """The middle partition's output takes another shape (as many positions as x has positive elements): its kept
    call's reply says the new shape, and the last partition's repeats carry it; every partition repeats its kept
    call whatever the shapes, and every result is right."""
    with InferenceSession(nonzero_model(), options_for(workers, "relu", "nz", "neg"), env=workers) as s:
        assert [a.registration for a in s.get_provider_graph_assignment_info()] == ["relu", "nz", "neg"]
        calls = Calls(workers, "relu", "nz", "neg")
        two = np.array([1, -1, 2, -2, -3, -4], np.float32)
        three = np.array([1, -1, 2, -2, 3, -4], np.float32)

        def run(x):
            (y,) = s.run(None, {"x": x})
            np.testing.assert_array_equal(y, -np.flatnonzero(x > 0).astype(np.float32)[None, :])

        for x in [two] * 3 + [three] * 4 + [two] * 4:
            run(x)
        for name in ("relu", "nz", "neg"):
            assert (calls.kept(name), calls.repeats(name)) == (1, 10), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["raise", "retry", "fallback"])
def test_a_worker_that_dies_in_a_middle_step_is_answered_by_the_failure_policy(policy):
    """The worker of a chain's middle partitions dies (a real SIGSEGV): the run fails with EpWorkerCrashed
    (raise), or the partition is made again on the restarted worker (retry) or on the CPU fallback (fallback)
    and the rest of the run goes on, with the right result; the runs after it are right."""
    rng = np.random.default_rng(7)
    ops = ["Relu", "Neg", "Relu"]
    with ephost.Environment() as env:
        options = dying_worker(env, policy, ("neg", "Neg"), 4, ("relu", "Relu"))
        with InferenceSession(models.chain(ops), options, env=env) as s:
            def run():
                x = rng.standard_normal(4).astype(np.float32)
                (y,) = s.run(None, {"x": x})
                np.testing.assert_array_equal(y, chain_expected(x, ops))

            for _ in range(3):
                run()
            if policy == "raise":  # the middle partition's 4th Compute
                with pytest.raises(ephost.EpWorkerCrashed, match="Ep/Compute"):
                    s.run(None, {"x": rng.standard_normal(4).astype(np.float32)})
            else:
                run()
            assert env.registration("neg").link.wait_healthy(10)
            for _ in range(2):
                run()
            assert s.failure_counters["runs"] == 6


def test_eight_threads_run_one_chain_each_on_its_own_kept_calls(workers):
    """Eight threads running one session whose chain alternates between two workers: each thread's calls are
    kept on its own lane connections, and every result is its own."""
    with InferenceSession(models.chain(CHAIN), options_for(workers, "relu", "neg"), env=workers) as s:
        calls = Calls(workers, "relu", "neg")

        def work(seed):
            rng = np.random.default_rng(seed)
            for _ in range(20):
                x = rng.standard_normal(4).astype(np.float32)
                (y,) = s.run(None, {"x": x})
                np.testing.assert_array_equal(y, chain_expected(x, CHAIN))

        assert in_threads(work, 8) == []
        assert (calls.kept(), calls.repeats()) == (8 * len(CHAIN), 8 * 19 * len(CHAIN))


# --- IOBinding runs: a decoding loop ------------------------------------------------------------------------

WIDTH = 16


def decoding(width: int = WIDTH):
    from bench.data_plane import decoding_model  # the bench's decoding loop runs the same step
    return decoding_model(width)


def rows(seed: int, steps: int, width: int = WIDTH) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((steps, 1, 1, width)).astype(np.float32)


class Loop:
    """A decoding loop through one IOBinding, as an application that keeps its state on the device runs it (the
    present bound to the worker's memory and bound as the next step's past), checked step by step against ORT's
    own loop in process."""

    def __init__(self, session, env, registration: str, width: int = WIDTH):
        self.session, self.width = session, width
        self.device = next(d for d in env.get_ep_devices() if d.registration_name == registration)
        self.binding = session.io_binding()
        self.binding.bind_cpu_input("past", np.zeros((1, 0, width), np.float32))
        self.binding.bind_output("present", self.device)
        self.binding.bind_output("score")
        self.reference = ort.InferenceSession(decoding(width).SerializeToString(), providers=["CPUExecutionProvider"])
        self.past = np.zeros((1, 0, width), np.float32)

    def step(self, row: np.ndarray, run_options=None) -> None:
        self.binding.bind_cpu_input("row", row)
        self.session.run_with_iobinding(self.binding, run_options)
        self.past, score = self.reference.run(None, {"past": self.past, "row": row})
        present, got = self.binding.get_outputs()
        np.testing.assert_array_equal(present.numpy(), self.past)
        np.testing.assert_allclose(got.numpy(), score, rtol=1e-5)
        self.binding.bind_ortvalue_input("past", present)


def test_a_decoding_loop_repeats_one_kept_call_whatever_its_shapes(env):
    """A loop whose state grows a row a step: the first step's call (its empty past from the application) and the
    second's (its past in the worker, named by handle) are kept, and every later step repeats the second's with
    its own shapes, its present left in the worker and labelled with the device's memory, every result ORT's. A
    new binding's loop on the same thread repeats the same two calls."""
    steps = 16
    with InferenceSession(decoding(), options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")
        loop = Loop(s, env, "ort")
        for row in rows(1, steps):
            loop.step(row)
        assert (calls.kept(), calls.repeats()) == (2, steps - 2)
        present = loop.binding.get_outputs()[0]
        assert present.memory_info == loop.device.memory_info(ephost.DeviceMemoryType.HOST_ACCESSIBLE)
        assert present.buffer is not None and present.buffer.owner is not None, "the present came back"
        second = Loop(s, env, "ort")
        for row in rows(2, steps):
            second.step(row)
        assert (calls.kept(), calls.repeats()) == (2, 2 * steps - 2)
        assert s.failure_counters["runs"] == 2 * steps


@pytest.mark.parametrize("rows", [4, 4096], ids=["128B", "128KiB"])
def test_a_loop_of_one_shape_bound_in_the_worker_repeats_its_kept_call(env, rows):
    """A loop whose state keeps its shape (an output bound to the worker's memory and bound as the next step's
    input): from the third step on, a repeat of the second's kept call, every result right (a small state copied
    in and out of the worker's ORT binding, a large one bound where it lies, a new buffer each step)."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    model = models.model([helper.make_node("Add", ["x", "one"], ["y"], name="add")], [models.tensor("x", [rows, 8])],
                         [models.tensor("y", [rows, 8])], [one])
    x0 = np.arange(-4 * rows, 4 * rows, dtype=np.float32).reshape(rows, 8)  # whole numbers: every sum exact
    with InferenceSession(model, options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")
        binding = s.io_binding()
        binding.bind_cpu_input("x", x0)
        binding.bind_output("y", next(d for d in env.get_ep_devices() if d.registration_name == "ort"))
        for step in range(1, 11):
            s.run_with_iobinding(binding)
            (y,) = binding.get_outputs()
            assert y.buffer is not None and y.buffer.owner is not None, "the output came back"
            np.testing.assert_array_equal(y.numpy(), x0 + step)
            binding.bind_ortvalue_input("x", y)
        assert (calls.kept(), calls.repeats()) == (2, 8)


def test_a_binding_of_large_inputs_writes_them_into_the_staging_buffers_kept_for_its_call(env):
    """A binding whose input is over the inline limit (bound from the application's memory, its output to the
    worker's device): from the second run on, a repeat of its kept call, the input written into the staging
    buffers the thread keeps for it; a larger input of the same kind in a run() since (which replaced those
    buffers and gave them back, a call of its own as its output comes back) changes nothing for the binding's
    runs, and every result is right."""
    rng = np.random.default_rng(7)
    device = next(d for d in env.get_ep_devices() if d.registration_name == "ort")
    with InferenceSession(staged_model(), options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")
        binding = s.io_binding()
        binding.bind_output("y", device)

        def run(rows: int) -> None:
            f = feeds(rng, rows)
            for name, value in f.items():
                binding.bind_cpu_input(name, value)
            s.run_with_iobinding(binding)
            (y,) = binding.get_outputs()
            assert y.buffer is not None and y.buffer.owner is not None, "the output came back"
            np.testing.assert_allclose(y.numpy(), expected(f), rtol=1e-4, atol=1e-4)

        for _ in range(6):
            run(256)
        assert (calls.kept(), calls.repeats()) == (1, 5)
        f = feeds(rng, 512)  # the same kinds, larger, in a run(): the thread's staging buffers for them replaced
        np.testing.assert_allclose(s.run(None, f)[0], expected(f), rtol=1e-4, atol=1e-4)
        for _ in range(4):
            run(256)
        assert (calls.kept(), calls.repeats()) == (2, 9)


def test_a_binding_run_that_changes_where_a_value_goes_keeps_a_call_of_its_own(env):
    """Run options with a deadline only, another binding of the session: the same kept calls. An output bound
    elsewhere, or a past in the application's memory: a call of their own (each kept once), every result right;
    the loop's own call serves it again after."""
    with InferenceSession(decoding(), options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")
        loop, data = Loop(s, env, "ort"), iter(rows(3, 40))
        for _ in range(4):
            loop.step(next(data))
        assert (calls.kept(), calls.repeats()) == (2, 2)
        loop.step(next(data), RunOptions(compute_timeout_s=30))
        assert (calls.kept(), calls.repeats()) == (2, 3)
        loop.binding.bind_output("present", "cpu")  # the present comes back: the next past is the application's
        loop.step(next(data))
        assert loop.binding.get_outputs()[0].buffer is None
        assert (calls.kept(), calls.repeats()) == (3, 3)
        loop.binding.bind_output("present", loop.device)
        loop.step(next(data))  # a past in the application's memory: the first step's call
        other = Loop(s, env, "ort")
        other.step(next(data))
        for _ in range(3):
            loop.step(next(data))
        assert (calls.kept(), calls.repeats()) == (3, 8)


@pytest.mark.parametrize("rows", [4, 2048], ids=["128B", "64KiB"])
def test_a_pair_of_worker_tensors_swapped_every_step_repeats_one_kept_call(env, rows):
    """Two tensors in the worker's memory, one bound as the input and the other as the output, swapped every step
    (ORT in the worker writes each step's output into the tensor bound for it): from the second step on, a repeat
    of the first's kept call, each step's output in the tensor it was bound to and its input left as it was. An
    output bound to a tensor of another shape is refused (as the worker refuses it), one bound to the
    application's memory is a call of its own, every result right; the pair's call serves the pair again after."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    model = models.model([helper.make_node("Add", ["x", "one"], ["y"], name="add")], [models.tensor("x", [rows, 8])],
                         [models.tensor("y", [rows, 8])], [one])
    x0 = np.arange(-4 * rows, 4 * rows, dtype=np.float32).reshape(rows, 8)  # whole numbers: every sum exact
    device = next(d for d in env.get_ep_devices() if d.registration_name == "ort")
    allocator = env.allocator_for(device.memory_info(ephost.DeviceMemoryType.HOST_ACCESSIBLE))
    with InferenceSession(model, options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")
        binding = s.io_binding()
        pair = [ephost.Tensor.from_numpy(x0, allocator), ephost.Tensor.empty(x0.shape, x0.dtype, allocator)]

        def step(n: int, output=None) -> None:
            binding.bind_ortvalue_input("x", pair[0])
            binding.bind_output("y", tensor=pair[1] if output is None else output)
            s.run_with_iobinding(binding)
            (y,) = binding.get_outputs()
            assert y is (pair[1] if output is None else output), "the output is not the tensor bound for it"
            np.testing.assert_array_equal(y.numpy(), x0 + n)
            np.testing.assert_array_equal(pair[0].numpy(), x0 + n - 1)  # the input as it was
            if output is None:
                pair.reverse()

        for n in range(1, 9):
            step(n)
        assert (calls.kept(), calls.repeats()) == (1, 7)
        other = ephost.Tensor.empty((rows, 16), x0.dtype, allocator)  # not the output's shape: the worker's error
        binding.bind_ortvalue_input("x", pair[0])
        binding.bind_output("y", tensor=other)
        refused = rf"float32\[{rows}, 8\] cannot be written into .*\[{rows}, 16\]"
        with pytest.raises(ephost.EpInvalidArgument, match=refused):
            s.run_with_iobinding(binding)
        host = ephost.Tensor.from_numpy(np.zeros((rows, 8), np.float32))  # the application's memory
        step(9, host)
        for n in range(9, 15):
            step(n)
        assert (calls.kept(), calls.repeats()) == (2, 13)


def test_a_binding_of_small_inputs_from_the_application_repeats_its_kept_call(env):
    """A binding whose only input is small, bound from the application every run (its bytes go in the frame, and
    nothing names a buffer), its output bound to the application: from the second run on, a repeat of the kept
    call, each run's output ORT's for that run's input."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    model = models.model([helper.make_node("Add", ["x", "one"], ["y"], name="add")], [models.tensor("x", [4, 8])],
                         [models.tensor("y", [4, 8])], [one])
    with InferenceSession(model, options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")
        binding = s.io_binding()
        binding.bind_output("y", "cpu")
        for n in range(6):
            x = np.full((4, 8), n, np.float32) + np.arange(8, dtype=np.float32)
            binding.bind_cpu_input("x", x)
            s.run_with_iobinding(binding)
            (y,) = binding.copy_outputs_to_cpu()
            np.testing.assert_array_equal(y, x + 1)
        assert (calls.kept(), calls.repeats()) == (1, 5)


def test_a_binding_run_checks_its_inputs_before_anything_is_sent(env):
    """A row of another width (the model fixes it): the session's EpInvalidArgument, nothing sent; the loop goes
    on repeating its kept call."""
    with InferenceSession(decoding(), options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")
        loop, data = Loop(s, env, "ort"), iter(rows(4, 20))
        for _ in range(4):
            loop.step(next(data))
        runs, sent = s.failure_counters["runs"], worker_stats(env, "ort").methods["Ep/Compute"].calls
        loop.binding.bind_cpu_input("row", np.zeros((1, 1, WIDTH + 1), np.float32))
        with pytest.raises(ephost.EpInvalidArgument, match="expects 16 along axis 2"):
            s.run_with_iobinding(loop.binding)
        assert s.failure_counters["runs"] == runs
        assert worker_stats(env, "ort").methods["Ep/Compute"].calls == sent
        loop.step(next(data))
        assert (calls.kept(), calls.repeats()) == (2, 3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["raise", "retry", "fallback"])
def test_a_worker_that_dies_in_a_binding_run_is_answered_by_the_failure_policy(policy):
    """The worker's EP dies (a real SIGSEGV) in a decoding loop's step: the step fails with EpWorkerCrashed
    naming the call (raise), or is made again on the restarted worker (retry) or on the CPU fallback (fallback),
    the state it was bound to read from the shared memory the dead worker left mapped here; the loop goes on from
    there (after `raise`, from the state the failed step was bound to) with the right results."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "chaos", {
            "wrap": "onnxruntime", "fault": "segfault", "at": "compute", "after": "5", "intra_op_num_threads": "1"})
        options = options_for(env, "w")
        options.ep_failure_policy = policy
        with InferenceSession(decoding(), options, env=env) as s:
            loop = Loop(s, env, "w")
            data = iter(rows(5, 30))
            for _ in range(4):
                loop.step(next(data))
            if policy == "raise":
                with pytest.raises(ephost.EpWorkerCrashed, match="Ep/Compute"):
                    loop.step(next(data))
            else:
                loop.step(next(data))
            assert env.registration("w").link.wait_healthy(10)
            for _ in range(3):  # (the new worker's 5th Compute would die too)
                loop.step(next(data))


def test_eight_threads_run_their_own_decoding_loops(env):
    """Eight threads, each its own binding's loop in one session: each repeats calls kept on its own lane
    connection, every result its own."""
    steps = 14
    with InferenceSession(decoding(), options_for(env, "ort"), env=env) as s:
        calls = Calls(env, "ort")

        def work(seed):
            loop = Loop(s, env, "ort")
            for row in rows(10 + seed, steps):
                loop.step(row)

        assert in_threads(work, 8) == []
        assert (calls.kept(), calls.repeats()) == (8 * 2, 8 * (steps - 2))
        assert s.failure_counters["runs"] == 8 * steps
