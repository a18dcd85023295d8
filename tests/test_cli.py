"""The command line: `ephost devices TARGET`, `ephost check TARGET` and `ephost stats TARGET`."""
import subprocess
import sys


def ephost(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ephost", *args], capture_output=True, text=True, timeout=timeout)


def test_devices_of_a_launched_ep_as_a_table():
    result = ephost("devices", "reference", "--option", "ops=Add,Mul")
    assert result.returncode == 0, result.stderr
    header, rule, row = result.stdout.splitlines()
    assert header.split()[:3] == ["EP", "EP", "vendor"] and set(rule) <= {"-", " "}
    assert row.split()[:3] == ["reference", "ephost", "CPU"]
    assert "reference_host_accessible (HOST_ACCESSIBLE)" in row and "ops=2" in row


def test_devices_of_a_running_worker(worker):
    w = worker("--ep", "reference")
    result = ephost("devices", w.address)
    assert result.returncode == 0, result.stderr
    assert "reference" in result.stdout.splitlines()[2]


def test_check_round_trips_a_tensor():
    result = ephost("check", "reference", "--mib", "8")
    assert result.returncode == 0, result.stderr
    assert "copied 8 MiB" in result.stdout and "identical" in result.stdout


def test_errors_are_one_clear_line():
    result = ephost("devices", "no-such-ep")
    assert result.returncode == 1
    assert "no EP named 'no-such-ep'" in result.stderr
    assert "Traceback" not in result.stderr
    result = ephost("devices", "unix:///nonexistent/ephost.sock", "--option", "connect_timeout_s=2")
    assert result.returncode == 1 and "EpWorkerUnavailable" in result.stderr and "Traceback" not in result.stderr


def test_run_shows_who_ran_what(tmp_path):
    import numpy as np
    import onnx
    import models
    onnx.save(models.diamond((2, 3)), tmp_path / "diamond.onnx")
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    np.save(tmp_path / "x.npy", x)
    result = ephost("run", str(tmp_path / "diamond.onnx"), "--ep", "reference", "--option", "ops=Add,Mul",
                    "--ep", "reference", "--option", "ops=Relu", "--input", f"x={tmp_path / 'x.npy'}", "--runs", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    table = lines[lines.index(next(l for l in lines if l.startswith("partition"))) + 2:][:3]
    assert [row.split()[:4] for row in table] == [["0", "reference", "reference", "1"],
                                                  ["1", "reference#1", "reference", "1"],
                                                  ["2", "reference", "reference", "1"]]
    assert "y  float32[2, 3]" in result.stdout and "time per run" in result.stdout


def test_run_without_a_model_checks_the_bundled_resnet50():
    """On OpenVINO where it has a device here (an Intel CPU), else on ORT's CPU EP; timed against the same EP in
    process, so that the ratio is ephost's."""
    result = ephost("run", "--runs", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "matches the expected output" in result.stdout
    assert "float32[1, 1000]" in result.stdout
    on_openvino = "OpenVINOExecutionProvider" in result.stdout.split("outputs:")[0]
    label = "OpenVINO's plugin EP" if on_openvino else "ONNX Runtime's CPU EP"
    assert f"in process, {label}: " in result.stdout, result.stdout


def test_run_shows_a_crash_and_the_fallback(tmp_path):
    import onnx
    import models
    onnx.save(models.diamond((2, 3)), tmp_path / "diamond.onnx")
    result = ephost("run", str(tmp_path / "diamond.onnx"), "--ep", "chaos", "--option", "fault=segfault",
                    "--option", "after=3", "--on-failure", "fallback", "--runs", "4")
    assert result.returncode == 0, result.stderr
    assert "run 3: chaos chaos_0 crashed: EpWorkerCrashed" in result.stdout and "SIGSEGV" in result.stdout
    assert "run 3: chaos chaos_0 fell back" in result.stdout
    assert "y  float32[2, 3]" in result.stdout
    failed = ephost("run", str(tmp_path / "diamond.onnx"), "--ep", "chaos", "--option", "fault=segfault",
                    "--option", "after=2", "--runs", "2")
    assert failed.returncode == 1 and "EpWorkerCrashed" in failed.stderr and "Traceback" not in failed.stderr


def test_structured_logs():
    import json
    result = ephost("--log-format", "json", "--log-level", "INFO", "devices", "reference")
    assert result.returncode == 0, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert any(e["logger"] == "ephost.client.environment" and "registered" in e["message"] for e in entries)
    assert all({"time", "level", "logger", "pid", "message"} <= set(e) for e in entries)


def test_stats_of_a_running_worker_as_tables(worker):
    w = worker("--ep", "reference")
    assert ephost("check", w.address, "--mib", "1").returncode == 0
    result = ephost("stats", w.address)
    assert result.returncode == 0, result.stderr
    counters, methods = result.stdout.split("\n\n")
    rows = {line.split()[0]: line.split()[1:] for line in counters.splitlines()[2:]}
    assert {"bytes_copied", "buffers_live", "clients", "compute_inputs_resident"} <= set(rows)
    calls = {line.split()[0]: int(line.split()[1]) for line in methods.splitlines()[2:]}
    assert calls["EpFactory/GetSupportedDevices"] == 2 and calls["Allocator/Alloc"] == 1, "check allocated once"
    result = ephost("stats", "inproc:reference")
    assert result.returncode == 1 and "hosted in this process" in result.stderr


def test_version_names_ephost_its_protocol_and_what_it_runs_on():
    import importlib.metadata
    result = ephost("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"ephost {importlib.metadata.version('ephost')} (wire protocol ephost.v1;")
    assert f"onnxruntime {importlib.metadata.version('onnxruntime')}" in result.stdout


def test_eps_lists_the_installed_eps_with_their_options_and_defaults():
    result = ephost("eps")
    assert result.returncode == 0, result.stderr
    eps, options, common = result.stdout.split("\n\n")
    assert {line.split()[0] for line in eps.splitlines()[2:]} >= {"reference", "onnxruntime", "chaos"}
    rows = {tuple(line.split()[:3]) for line in options.splitlines()[2:]}
    assert ("onnxruntime", "graph_optimization_level", "all") in rows and ("chaos", "wrap", "reference") in rows
    assert any(line.split()[:3] == ["(any)", "recovery_timeout_s", "30"] for line in common.splitlines())


def test_a_large_transfer_draws_a_progress_bar_on_a_terminal(worker):
    """`ephost check` against a worker whose memory it cannot share: the tensor goes in chunks, and the terminal
    (a real pseudo-terminal here) shows one line redrawn, up to 100%."""
    import os
    import pty
    w = worker("--ep", "reference")
    main, child = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ephost", "check", w.address, "--mib", "80", "--option",
                                 "shared_memory=false"], stdout=subprocess.PIPE, stderr=child, text=True)
        os.close(child)
        drawn = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the terminal's other end closed
                break
            if not chunk:
                break
            drawn += chunk
        out, _ = proc.communicate(timeout=120)
    finally:
        os.close(main)
    assert proc.returncode == 0 and "identical" in out, (out, drawn)
    text = drawn.decode(errors="replace")
    assert "\r\x1b[K" in text and "writing a tensor into the worker" in text and "100%" in text, text[-500:]
