"""`make bench` runs `python -m bench` with no argument: every bench; a name picks some, an unknown one is an
error that says what there is."""
import os
import subprocess
import sys

import pytest

from bench.__main__ import BENCHES, parse_args


def test_no_argument_means_every_bench_and_names_pick_some():
    assert parse_args([]).which == []
    assert parse_args(["--quick", "copy", "dataplane"]).which == ["copy", "dataplane"]


def test_an_unknown_bench_is_an_error_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["nosuch"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no bench nosuch" in err and all(name in err for name, _ in BENCHES)


def test_the_command_line_parses_as_make_bench_calls_it():
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "dataplane" in out.stdout


def test_the_ab_bench_runs_a_revisions_stack_beside_the_working_trees():
    """bench/ab.py: two whole stacks taking turns, one importing ephost from the revision's checkout, the other
    from the working tree; it prints where each came from, both medians and the paired difference."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "bench/ab.py", "HEAD", "tiny", "--blocks", "2", "--per", "20"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    where, result = out.stdout.strip().splitlines()[-2:]
    base, new = where.split("; working tree: ")
    assert "ephost-ab-" in base and base.rstrip().endswith(os.path.join("package", "ephost"))
    assert new == os.path.join(root, "ephost")
    assert result.startswith("tiny, 2 blocks of 20: HEAD ") and "of 2 blocks" in result
    missing = subprocess.run([sys.executable, "bench/ab.py"], cwd=root, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "name a git revision" in missing.stderr


def test_the_ab_bench_times_a_decoding_loop_per_step():
    """bench/ab.py's decoding workload: bench dataplane's loop (its state bound in the worker and fed back), run
    whole and reported per step."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "bench/ab.py", "HEAD", "decoding", "--blocks", "2", "--per", "2"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = out.stdout.strip().splitlines()[-1]
    assert result.startswith("decoding, 2 blocks of 2: HEAD ") and "µs per step" in result


@pytest.mark.parametrize("workload", ["loop", "pair"])
def test_the_ab_bench_times_an_iobinding_loop_bound_in_the_worker_per_step(workload):
    """bench/ab.py's loop and pair workloads: bench iobinding's 4 KiB step with its output bound to the worker's
    device and fed back, or two tensors of the worker's swapped, reported per step; they bind in the worker
    already, so --binding is refused for them."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ab = [sys.executable, "bench/ab.py", "HEAD", workload, "--blocks", "2", "--per", "5"]
    out = subprocess.run(ab, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = out.stdout.strip().splitlines()[-1]
    assert result.startswith(f"{workload}, 2 blocks of 5: HEAD ") and "µs per step" in result
    refused = subprocess.run(ab + ["--binding"], cwd=root, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "binds its state in the worker" in refused.stderr


def test_the_ab_bench_registers_both_stacks_eps_with_the_options_given():
    """`--option KEY=VALUE` reaches the registrations of both stacks' EPs: one they refuse fails the run with
    their error, one they take is named in the result."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ab = [sys.executable, "bench/ab.py", "HEAD", "tiny", "--blocks", "2", "--per", "10"]
    out = subprocess.run(ab + ["--option", "kept_calls=false"], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("tiny (kept_calls=false), 2 blocks of 10: HEAD ")
    refused = subprocess.run(ab + ["--option", "fast_lane_spin_us=soon"], cwd=root, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 1 and "bad supervision option" in refused.stderr
    assert refused.stderr.rstrip().endswith("stack did not start (see the error above)")
    malformed = subprocess.run(ab + ["--option", "kept_calls"], cwd=root, capture_output=True, text=True, timeout=60)
    assert malformed.returncode == 2 and "is not KEY=VALUE" in malformed.stderr


def test_the_ab_benchs_sign_test_says_how_likely_a_split_of_blocks_is_by_chance():
    from bench.ab import sign_test
    assert sign_test(10, 20) == 1.0  # an even split: what a coin gives
    assert sign_test(15, 20) == sign_test(5, 20)  # two-sided
    assert abs(sign_test(15, 20) - 0.0414) < 1e-3  # 2 * P(X <= 5), X ~ Binomial(20, 1/2)
    assert sign_test(20, 20) == 2 / 2 ** 20
    assert sign_test(0, 1) == 1.0


def test_the_cnn_ratios_are_taken_round_by_round_so_the_machines_mood_falls_on_both_sides():
    """bench's CNN ratios: each round runs every way's block side by side; the ratio is the median of the rounds'
    ratios, which a host whose speed changes between (or once within) rounds does not move; a ratio of the overall
    medians would."""
    from bench.session_overhead import interleaved_blocks, medians, paired_ratio
    # Out of process 1.04 of in process; the host twice as slow from round 3 on, from just after its in block.
    rounds = {"in": [[1.0] * 3, [1.0] * 3, [1.0] * 3, [2.0] * 3, [2.0] * 3],
              "out": [[1.04] * 3, [1.04] * 3, [2.08] * 3, [2.08] * 3, [2.08] * 3]}
    assert abs(paired_ratio(rounds, "out", "in") - 1.04) < 1e-9
    t = medians(rounds)
    assert abs(t["out"] / t["in"] - 2.08) < 1e-9  # what the overall medians make of the same blocks
    calls = []
    blocks = interleaved_blocks({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3, 10)
    assert [len(b) for b in blocks["a"]] == [10, 10, 10] and [len(b) for b in blocks["b"]] == [10, 10, 10]
    assert calls.count("a") == calls.count("b")


def test_the_iobinding_bench_checks_every_way_against_ort_in_process():
    """bench iobinding times its loops, then checks one more step of each way against ORT in process: every way
    of a real worker passes, and a way whose output is not the step's (the input fed back as it was) is refused."""
    import numpy as np
    from bench.iobinding import check, in_process, measure, recurrent
    result = measure(64, 2, True, blocks=1, block=3)
    assert set(result) == {"in process", "run", "device", "alternating"}
    model = recurrent(64, 2, True)
    x0 = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    reference = in_process(model, x0)

    def stuck():  # a step that writes nothing: its state stays the input
        pass
    stuck.state = lambda: x0
    check({"in process": reference}, reference.session)
    with pytest.raises(AssertionError, match="stuck: a step's output is not"):
        check({"stuck": stuck}, reference.session)


def test_the_split_chain_keeps_a_value_in_one_worker_for_its_next_partition_and_computes_as_ort():
    """bench dataplane's split chain: through two reference workers, each of the first's partitions but the last
    keeps its Neg for its next partition (the plan's `keep`), and the result is ORT's in process."""
    import numpy as np
    import onnxruntime as ort
    import ephost
    from bench.data_plane import split_model
    from bench.session_overhead import options_for
    model = split_model(3)
    x = np.random.default_rng(4).standard_normal(16).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with ephost.Environment() as env:
        env.register_execution_provider_library("ns", "reference", {"ops": "Neg,Sub"})
        env.register_execution_provider_library("relu", "reference", {"ops": "Relu"})
        with ephost.InferenceSession(model, options_for(env, "ns", "relu"), env=env) as session:
            assert [a.registration for a in session.get_provider_graph_assignment_info()] == ["ns", "relu"] * 3 + ["ns"]
            assert [p.keep for p in session._runner.partitions][0::2] == [(0,)] * 3 + [()]
            for _ in range(3):  # the first run keeps the calls, the next repeat them
                np.testing.assert_allclose(session.run(None, {"x": x})[0], expected[0], rtol=1e-6)


def test_the_cnn_table_runs_the_input_bound_in_the_worker_and_the_floor_as_ort_runs_them():
    """bench dataplane's columns beside the fast lane's ways: the session run through an IOBinding with its input in
    a tensor of the worker's memory gives ORT's outputs with nothing of the input staged or copied a run, and the
    floor's child process runs the model for a byte, ends when its socket closes, and says so where it cannot
    start."""
    import numpy as np
    import onnx
    import ephost
    from ephost.cli.run_command import bundled_input, bundled_model
    from bench.data_plane import OneByteRuns, bound_input
    from bench.session_overhead import in_process_session, options_for
    model = onnx.load(bundled_model("squeezenet")[0])
    ort_session = in_process_session(model, "ORT CPU")
    feeds = {arg.name: bundled_input(arg) for arg in ort_session.get_inputs()}
    expected = ort_session.run(None, feeds)[0]
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime")
        def calls() -> dict[str, int]:
            methods = env.get_worker_stats("ort").methods
            return {m: methods[m].calls if m in methods else 0
                    for m in ("Ep/Compute", "Allocator/Alloc", "DataTransfer/CopyTensors")}
        with ephost.InferenceSession(model, options_for(env, "ort"), env=env) as session:
            run = bound_input(env, session, "ort", feeds)
            before = calls()
            for _ in range(3):  # the first run keeps the call, the next repeat it
                (y,) = run()
                np.testing.assert_allclose(y.numpy(), expected, rtol=1e-4, atol=1e-5)
            # The input went by handle: no staging buffer made for it, no copy into the worker
            assert calls() == {**before, "Ep/Compute": before["Ep/Compute"] + 3}
    with OneByteRuns("squeezenet") as floor:
        for _ in range(3):
            floor.run()
        assert floor.process.poll() is None
    assert floor.process.returncode == 0
    with pytest.raises(RuntimeError, match="did not start"):
        OneByteRuns("no_such_model")


@pytest.mark.parametrize("binding,label", [("--binding", "through an IOBinding"),
                                           ("--binding=worker", "through an IOBinding, its input in the worker")])
def test_the_ab_bench_runs_a_workload_through_an_iobinding(binding, label):
    """`--binding` binds the feeds from the application every run; `--binding=worker` binds them once as tensors
    of the worker's memory (bench dataplane's "input in the worker" column); the result names which."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "bench/ab.py", "HEAD", "tiny", "--blocks", "2", "--per", "10", binding],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith(f"tiny ({label}), 2 blocks of 10: HEAD ")


def test_the_cnn_runs_bench_gives_each_run_then_the_median_and_the_runs_over_the_target():
    """bench cnnruns: the CNN rows made again in new Environments, a row a run, then the median of each column and
    how many runs read over 1.05 (what one run of bench dataplane cannot say: bench/RESULTS.md)."""
    from bench.cnn_runs import summary
    runs = [{"squeezenet": {"lane": r, "floor": 1.0}} for r in (1.02, 1.07, 1.04, 1.06, 1.03)]
    assert summary(runs) == {("squeezenet", "lane"): (1.04, 2), ("squeezenet", "floor"): (1.0, 0)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "bench", "--quick", "cnnruns"], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows] == ["run", "1", "2", "median", "over 1.05"]
    assert len(rows[0]) == 7 and "squeezenet: fast lane / in" in rows[0][1]
    for run in rows[1:3]:
        assert all(float(cell) > 0 for cell in run[1:])  # ratios: how large depends on the machine's load
    medians = [float(cell.strip(" *")) for cell in rows[3][1:]]
    assert all(abs(m - (float(a) + float(b)) / 2) < 0.0011 for m, a, b in zip(medians, rows[1][1:], rows[2][1:]))
    assert all(cell.strip().endswith("of 2") for cell in rows[4][1:])
