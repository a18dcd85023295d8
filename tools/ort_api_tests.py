"""ONNX Runtime's own Python API tests, run twice: with ORT's session classes (the baseline) and with ephost's in
their place (onnxruntime.InferenceSession, SessionOptions, RunOptions and IOBinding; each session on ORT's CPU EP in
an ephost worker, then what the test names). Writes one JSON line per test and prints the count: of the tests that
use the session classes, pass with ORT and need none of ORT's internals (`sess._sess`), how many pass on ephost.

    python tools/ort_api_tests.py DIR [--out FILE] [-k SUBSTRING] [--providers given|worker|named]

DIR holds ORT's onnxruntime/test/python/onnxruntime_test_python.py, onnxruntime_test_python_iobinding.py and
helper.py (an ORT checkout's, or fetched). Their models are read from DIR/testdata or DIR/../testdata where those
hold them, else made by tools/ort_testdata.py. The tests run in a copy of DIR (they write files where they run).
`make ort-api ORT_TESTS=DIR` runs it.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = ("onnxruntime_test_python", "onnxruntime_test_python_iobinding")
FILES = (*(m + ".py" for m in MODULES), "helper.py")
TEST_TIMEOUT_S = 120
_used = {"flag": False}  # whether the running test made one of the session classes


def _mark() -> None:
    _used["flag"] = True


def _marking(base):
    """A subclass of `base` that marks the running test as using the session classes."""
    def __init__(self, *args, **kwargs):
        _mark()
        base.__init__(self, *args, **kwargs)
    return type(base.__name__, (base,), {"__init__": __init__})


def patch_ort() -> None:
    """ORT's own classes, marked only."""
    import onnxruntime as ort

    ort.InferenceSession, ort.SessionOptions, ort.RunOptions = (
        _marking(ort.InferenceSession), _marking(ort.SessionOptions), _marking(ort.RunOptions))


def patch_ephost(which: str) -> None:
    """ephost's classes in ORT's place; every session's EPs: one ORT worker ("onnxruntime", shared), then what the
    test names (`which` "given"), or the worker alone ("worker"); or what the test names alone ("named": ORT's
    CPU EP is then ephost's CPU fallback, in this process)."""
    import onnxruntime as ort

    import ephost

    worker = [] if which == "named" else ["onnxruntime"]
    if worker:
        ephost.get_default_environment().register_execution_provider_library("onnxruntime", "onnxruntime")

    class InferenceSession(ephost.InferenceSession):
        def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
            _mark()
            given = list(providers or [])
            if provider_options is not None:
                given = list(zip(given, provider_options))
            if which == "worker":
                given = []
            super().__init__(path_or_bytes, sess_options, providers=[*worker, *given], **kwargs)

    ort.InferenceSession = InferenceSession
    ort.SessionOptions, ort.RunOptions = _marking(ephost.SessionOptions), _marking(ephost.RunOptions)
    ort.IOBinding = ephost.IOBinding


def _onnx_mapping() -> None:
    """onnx 1.19 removed onnx.mapping, which the IOBinding tests import; its table lives on in onnx._mapping."""
    try:
        import onnx.mapping  # noqa: F401
    except ImportError:
        import onnx
        import onnx._mapping
        shim = types.ModuleType("onnx.mapping")
        shim.TENSOR_TYPE_MAP = onnx._mapping.TENSOR_TYPE_MAP
        sys.modules["onnx.mapping"] = onnx.mapping = shim


class _TimedOut(Exception):
    pass


def _alarm(signum, frame):
    raise _TimedOut(f"the test ran over {TEST_TIMEOUT_S} s")


def _tests(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _tests(item)
        else:
            yield item


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_tests(mode: str, providers: str, out: str, only: str) -> None:
    """In the copy of DIR this process runs in: each test, one JSON line in `out`."""
    sys.path.insert(0, os.getcwd())
    _onnx_mapping()
    patch_ort() if mode == "ort" else patch_ephost(providers)
    signal.signal(signal.SIGALRM, _alarm)
    with open(out, "w") as f:
        for module_name in MODULES:
            module = __import__(module_name)
            for test in _tests(unittest.TestLoader().loadTestsFromModule(module)):
                name = f"{module_name}.{test.id().split('.', 1)[1]}"
                if only not in name:
                    continue
                source = inspect.getsource(getattr(test, test._testMethodName))
                _used["flag"] = False
                result = unittest.TestResult()
                signal.alarm(TEST_TIMEOUT_S)
                try:
                    test.run(result)
                finally:
                    signal.alarm(0)
                failed = result.errors + result.failures
                if failed:
                    status, message = "fail", _last_line(failed[0][1])
                elif result.skipped:
                    status, message = "skip", result.skipped[0][1]
                else:
                    status, message = "pass", ""
                record = {"test": name, "status": status, "used": _used["flag"], "internals": "._sess" in source,
                          "message": message}
                if failed:
                    record["traceback"] = failed[0][1][-3000:]
                f.write(json.dumps(record) + "\n")
                f.flush()
                print(f"{mode:6} {status:4} {name} {message[:150]}", flush=True)


def _testdata(source: str) -> str | None:
    for candidate in (os.path.join(source, "testdata"), os.path.join(source, "..", "testdata")):
        if os.path.exists(os.path.join(candidate, "mul_1.onnx")):
            return os.path.abspath(candidate)
    return None


def _run_mode(mode: str, source: str, args, out: str) -> dict[str, dict]:
    """Run the tests in a child process of their own (a fresh onnxruntime module), in a copy of `source`."""
    with tempfile.TemporaryDirectory(prefix=f"ort-api-{mode}-") as work:
        for name in FILES:
            shutil.copy(os.path.join(source, name), work)
        found = _testdata(source)
        if found:
            os.symlink(found, os.path.join(work, "testdata"))
        else:
            sys.path.insert(0, HERE)
            import ort_testdata
            ort_testdata.write(os.path.join(work, "testdata"))
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--providers", args.providers,
                        "-k", args.k, "--out", out, source], cwd=work, check=False)
    with open(out) as f:
        return {r["test"]: r for r in map(json.loads, f)}


def compare(ort: dict[str, dict], eph: dict[str, dict]) -> tuple[list[dict], str]:
    """One row per test ORT's run saw, and the count."""
    rows = []
    for name, base in ort.items():
        mine = eph.get(name, {"status": "missing", "message": ""})
        counted = base["used"] and base["status"] == "pass" and not base["internals"]
        rows.append({"test": name, "ort": base["status"], "ephost": mine["status"], "uses_session": base["used"],
                     "needs_internals": base["internals"], "counted": counted, "message": mine["message"]})
    counted = [r for r in rows if r["counted"]]
    passed = sum(r["ephost"] == "pass" for r in counted)
    internals = sum(r["uses_session"] and r["ort"] == "pass" and r["needs_internals"] for r in rows)
    count = (f"ephost passes {passed} of {len(counted)} (tests that use the session classes and pass with ORT: "
             f"{len(counted) + internals}, less {internals} needing ORT's internals)")
    return rows, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the directory of ORT's test files")
    ap.add_argument("--out", default="build/ort-api/results.jsonl", help="the per-test results (JSON lines)")
    ap.add_argument("-k", default="", help="only the tests whose name holds this")
    ap.add_argument("--providers", choices=["given", "worker", "named"], default="given",
                    help="ephost's sessions: the ORT worker, then what the test names (given), the worker alone "
                         "(worker), or what the test names alone (named: ORT's CPU EP in this process)")
    ap.add_argument("--child", choices=["ort", "ephost"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_tests(args.child, args.providers, args.out, args.k)
        return 0
    source = os.path.abspath(args.dir)
    missing = [n for n in FILES if not os.path.exists(os.path.join(source, n))]
    if missing:
        ap.error(f"{source} lacks {', '.join(missing)}")
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    stem = os.path.splitext(out)[0]
    rows, count = compare(_run_mode("ort", source, args, stem + ".ort.jsonl"),
                          _run_mode("ephost", source, args, stem + ".ephost.jsonl"))
    with open(out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for row in rows:
        if row["counted"] and row["ephost"] != "pass":
            print(f"FAIL {row['test']}: {row['message'][:200]}")
        elif row["uses_session"] and row["needs_internals"]:
            print(f"(needs ORT's internals) {row['test']}: {row['ephost']}")
    print(count)
    print(f"per test: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
