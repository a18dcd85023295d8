"""Host -> worker tensor copy bandwidth, measured side by side in one run.

Rows are tensor sizes; columns are ways of getting a host array's bytes into a worker's tensor:
- memcpy: np.copyto between two arrays of this process (the limit);
- ephost shm: Environment.copy_tensors into a HOST_ACCESSIBLE worker tensor (the worker's shared memory is
  mapped here, so this is one memcpy plus ephost's bookkeeping, no call);
- ephost to DEFAULT: Environment.copy_tensors into a DEFAULT (worker-private) tensor: the bytes are written
  into a staging buffer of the worker's shared memory and one CopyTensors call copies them on (two memcpys,
  a few calls; small tensors go inline instead);
- gRPC inline: one CopyTensors call that carries the bytes inline into a DEFAULT tensor (what a transport
  without shared memory costs).
Each cell is the median of repeated copies; ratios are to memcpy of the same size in the same run.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

import ephost
from ephost import DeviceMemoryType, Tensor

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB]


def median_seconds(fn, nbytes: int, quick: bool) -> float:
    fn()  # warm: page faults, first mapping of a region
    reps = max(3 if quick else 5, min(200, (256 * MiB) // max(nbytes, 1) // (8 if quick else 1)))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(quick: bool = False) -> None:
    sizes = SIZES[:-1] if quick else SIZES
    with ephost.Environment() as env:
        env.register_execution_provider_library("bench", "reference")
        (device,) = env.get_ep_devices()
        shared = env.create_shared_allocator(device, DeviceMemoryType.HOST_ACCESSIBLE)
        private = env.create_shared_allocator(device, DeviceMemoryType.DEFAULT)
        rows = []
        for nbytes in sizes:
            src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
            host = Tensor.from_numpy(src)
            plain_dst = np.empty_like(src)
            shm_dst = Tensor.empty(src.shape, src.dtype, shared)
            default_dst = Tensor.empty(src.shape, src.dtype, private)
            inline = inline_copy(env, "bench", src, default_dst)
            ways = {
                "memcpy": lambda: np.copyto(plain_dst, src),
                "ephost shm": lambda: env.copy_tensors([host], [shm_dst]),
                "ephost to DEFAULT": lambda: env.copy_tensors([host], [default_dst]),
                "gRPC inline": inline,
            }
            seconds = {name: median_seconds(fn, nbytes, quick) for name, fn in ways.items()}
            back = Tensor.from_numpy(np.empty_like(src))
            env.copy_tensors([default_dst], [back])
            assert np.array_equal(back.numpy(), src) and np.array_equal(shm_dst.numpy(), src)
            rows.append((nbytes, seconds))
            shm_dst.release()
            default_dst.release()
    print_table(rows)


def inline_copy(env, registration: str, src: np.ndarray, dst: Tensor):
    """One CopyTensors call with the source bytes inline, as a client without shared memory makes it."""
    from ephost.types import desc_to_proto
    from ephost.v1 import common_pb2, data_transfer_pb2
    reg = env.registration(registration)
    conn, desc = reg.link.conn, desc_to_proto(src.shape, src.dtype)

    def copy():
        conn.call(conn.data_transfer.CopyTensors, data_transfer_pb2.CopyTensorsRequest(
            data_transfer=reg.data_transfer.handle, src=[common_pb2.TensorRef(desc=desc, inline=src.tobytes())],
            dst=[common_pb2.TensorRef(desc=desc, buffer=dst.buffer.handle)]))
    return copy


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def print_table(rows) -> None:
    names = list(rows[0][1])
    header = ["size"] + [f"{n} GB/s" for n in names] + [f"{n} / memcpy" for n in names[1:]]
    lines = [header]
    for nbytes, seconds in rows:
        rate = {n: nbytes / s / 1e9 for n, s in seconds.items()}
        lines.append([_size(nbytes)] + [f"{rate[n]:.2f}" for n in names]
                     + [f"{rate[n] / rate['memcpy']:.2f}" for n in names[1:]])
    print("Host -> worker tensor copy bandwidth (median of repeated copies; ratios to memcpy in the same run)\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for line in lines[1:]:
        print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    main()
