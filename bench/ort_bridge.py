"""ephost.ort, the bridge that makes ephost an ONNX Runtime plugin EP library: per-run time of an ORT session
whose nodes run in a worker (ORT's CPU EP hosted out of process, reached through the bridge) beside the same
model on ORT's CPU EP in process, hot loops of one session each (interleaved blocks), medians; and the bytes
the bridge copied per run (ORT's inputs into the worker's memory or the call, the outputs back into ORT's) and
the tensors it handed over without a copy (in the worker's shared memory, the bridged device's memory). Rows
marked "input on the device" give the bridged session its inputs as OrtValues on that device (IOBinding); ORT
alone is given the same arrays with a plain run."""
from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

import ephost
import ephost.ort
from bench.data_plane import interleaved, large_model
from bench.session_overhead import SESSION_CONFIG, tiny_model
from ephost.cli.run_command import bundled_input, bundled_model


def session(model, bridged: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    for key, value in SESSION_CONFIG.items():
        options.add_session_config_entry(key, value)
    if bridged:
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "bench_bridge"], {})
    else:
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider"], {})
    s = ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(), options)
    s.disable_fallback()
    return s


def device_binding(session: ort.InferenceSession, feeds: dict):
    """An IOBinding with the inputs in OrtValues on the bridged device (the worker's shared memory), and a run
    that binds the outputs afresh (so ORT allocates them in Compute, where the bridge hands over the worker's)."""
    import numpy as np
    (device,) = [d for d in ort.get_ep_devices() if d.ep_name == "bench_bridge"]
    memory = device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
    binding = session.io_binding()
    kept = []
    for name, array in feeds.items():
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype, memory_info=memory)
        value.update_inplace(np.ascontiguousarray(array))
        binding.bind_ortvalue_input(name, value)
        kept.append(value)
    outputs = [o.name for o in session.get_outputs()]

    def run():
        for name in outputs:
            binding.bind_output(name)
        session.run_with_iobinding(binding)
        return binding.get_outputs(), kept
    return run


def main(quick: bool = False) -> None:
    import numpy as np
    logging.getLogger("ephost").setLevel(logging.WARNING)
    # ORT thread spinning off in the worker too, as in this process (the data plane bench does the same)
    ephost.ort.register("bench_bridge", "onnxruntime",
                        {"session_config": ";".join(f"{k}={v}" for k, v in SESSION_CONFIG.items())})
    try:
        rows = []
        squeezenet, _ = bundled_model("squeezenet")
        cases = (("tiny (Add, 16 floats)", tiny_model(), False, 5 if quick else 20, 50 if quick else 200),
                 ("squeezenet", squeezenet, False, 3 if quick else 8, 3 if quick else 10),
                 ("squeezenet, input on the device (IOBinding)", squeezenet, True, 3 if quick else 8,
                  3 if quick else 10),
                 ("Neg(Relu(x)), 1 MiB", large_model(), False, 3 if quick else 10, 10 if quick else 40),
                 ("Neg(Relu(x)), 1 MiB, input on the device (IOBinding)", large_model(), True, 3 if quick else 10,
                  10 if quick else 40))
        for label, model, on_device, blocks, per_block in cases:
            alone, bridged = session(model, False), session(model, True)
            feeds = {i.name: (bundled_input(i) if isinstance(model, str) else
                              np.random.default_rng(0).standard_normal([int(d) for d in i.shape]).astype(np.float32))
                     for i in alone.get_inputs()}
            env = ephost.ort.environment("bench_bridge")  # the same worker, through ephost's own session
            options = ephost.SessionOptions()
            options.add_provider_for_devices(env.get_ep_devices())
            own = ephost.InferenceSession(model, options, env=env)
            bridged_run = device_binding(bridged, feeds) if on_device else lambda: bridged.run(None, feeds)
            before = ephost.ort.stats("bench_bridge")
            times = interleaved({"alone": lambda: alone.run(None, feeds), "bridge": bridged_run,
                                 "ephost": lambda: own.run(None, feeds)}, blocks, per_block)
            own.close()
            after = ephost.ort.stats("bench_bridge")
            runs = max(after.computes - before.computes, 1)
            copied = (after.bytes_in_copied - before.bytes_in_copied + after.bytes_out_copied -
                      before.bytes_out_copied) / runs
            in_place = (after.inputs_in_place - before.inputs_in_place + after.outputs_in_place -
                        before.outputs_in_place) / runs
            rows.append((label, times["alone"], times["bridge"], times["ephost"], copied, in_place))
            alone = bridged = bridged_run = None  # this case's sessions go before the next case's
        print("ORT session, nodes on ORT's CPU EP in process vs through ephost.ort into a worker hosting it; "
              "median per run\n")
        print("| model | ORT CPU EP in process | ORT + bridge | overhead per run | ratio | ephost session, same worker "
              "| bytes the bridge copied per run | tensors handed over in place per run |")
        print("|---|---|---|---|---|---|---|---|")
        for label, t_alone, t_bridge, t_own, copied, in_place in rows:
            print(f"| {label} | {t_alone * 1e6:.1f} µs | {t_bridge * 1e6:.1f} µs | "
                  f"{(t_bridge - t_alone) * 1e6:.1f} µs | {t_bridge / t_alone:.2f}x | {t_own * 1e6:.1f} µs | "
                  f"{copied:,.0f} B | {in_place:.1f} |")
        tiny_alone, tiny_bridge = rows[0][1], rows[0][2]
        c = c_host(quick)
        print("\nThe tiny model from a C application (tests/native/ort_host.c: no Python of its own; through the "
              "bridge, ephost's library embeds it), median per run, beside the Python application's above\n")
        print("| application | ORT CPU EP in process | ORT + bridge | overhead per run |")
        print("|---|---|---|---|")
        for label, alone, bridged in (("C (Python embedded by the bridge)", c["alone"], c["bridge"]),
                                      ("Python", tiny_alone, tiny_bridge)):
            print(f"| {label} | {alone * 1e6:.1f} µs | {bridged * 1e6:.1f} µs | {(bridged - alone) * 1e6:.1f} µs |")
    finally:
        ephost.ort.unregister("bench_bridge")


HOST_SOURCE = Path(__file__).resolve().parent.parent / "tests" / "native" / "ort_host.c"


class CHost:
    """tests/native/ort_host.c running one session: an ONNX Runtime application in C, without Python of its own
    (with ephost's library, the library starts Python in it)."""

    def __init__(self, binary: Path, plugin: str, model: Path, config: Path, inputs: str, outputs: str, shape):
        env = {**os.environ, "EPHOST_CONFIG": str(config), "EPHOST_PYTHON": sys.executable,
               "ORT_HOST_CONFIG": ";".join(f"{k}={v}" for k, v in SESSION_CONFIG.items())}
        library = next((Path(ort.__file__).parent / "capi").glob("libonnxruntime.so.*"))
        self.proc = subprocess.Popen([str(binary), str(library), plugin, "bench_c", str(model), inputs, outputs,
                                      ",".join(map(str, shape))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=model.parent)
        while not (line := self._line()).startswith("ready"):
            pass

    def _line(self) -> str:
        line = self.proc.stdout.readline().strip()
        if not line or line.startswith("fatal"):
            raise RuntimeError(f"ort_host: {line or 'ended'}")
        return line

    def median_ns(self, feed: Path, runs: int) -> int:
        self.proc.stdin.write(f"time {feed} {runs}\n")
        self.proc.stdin.flush()
        return int(self._line().split()[1])

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(60)


def c_host(quick: bool = False) -> dict[str, float]:
    """Per run of the tiny model from a C application: ORT's CPU EP alone, and through the bridge (Python embedded
    by ephost's library), blocks taking turns; medians over the blocks' medians, in seconds."""
    import numpy as np
    with tempfile.TemporaryDirectory(prefix="ephost-bench-") as tmp:
        tmp = Path(tmp)
        binary = tmp / "ort_host"
        subprocess.run(["cc", "-O2", "-o", str(binary), str(HOST_SOURCE), "-ldl"], check=True)
        model = tmp / "tiny.onnx"
        onnx.save(tiny_model(), str(model))
        feed = tmp / "x.bin"
        np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32).tofile(feed)
        config = tmp / "ephost.toml"
        spin = ";".join(f"{k}={v}" for k, v in SESSION_CONFIG.items())
        config.write_text(f'[registrations.bench_c]\ntarget = "onnxruntime"\n'
                          f'options = {{ session_config = "{spin}" }}\n')
        hosts = {"alone": CHost(binary, "-", model, config, "x", "y", (1, 16)),
                 "bridge": CHost(binary, ephost.ort.library_path(), model, config, "x", "y", (1, 16))}
        try:
            blocks, per = (5, 200) if quick else (20, 500)
            for host in hosts.values():
                host.median_ns(feed, per)  # warm
            times = {name: [] for name in hosts}
            for _ in range(blocks):
                for name, host in hosts.items():
                    times[name].append(host.median_ns(feed, per))
            return {name: statistics.median(t) / 1e9 for name, t in times.items()}
        finally:
            for host in hosts.values():
                host.close()
