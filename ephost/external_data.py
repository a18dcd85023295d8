"""External data: initializers whose bytes live in files beside a model, kept as references (file, offset,
length) until the side that runs their node needs them, and then mapped, never read through the application.

On the wire a tensor's external_data `location` is a *name*, never a path: it names one entry of the
ModelRef's `files`, which says where the bytes are (a descriptor this client handed the worker over the
descriptor socket). The worker opens nothing a client names. Both sides hold the same object, `ExternalData`:
names -> `ExternalFile` (an open, read-only descriptor and its size), mapped on first use. The application
makes one from a model file (`load_model`), checking every reference; a worker makes one from the descriptors
it was handed (`ExternalData.check` does the same checks against the sizes it sees itself).
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
import onnx
from onnx import TensorProto

from ephost.errors import (EpFailedPrecondition, EpInvalidArgument, EpInvalidModel, EpNoSuchFile, EpNotFound,
                           EpOutOfRange, quoted)
from ephost.memory import SIZE_SEALS
from ephost.types import dtype_of, nbytes_of

log = logging.getLogger(__name__)

# protobuf cannot serialize or parse a message over 2 GiB
PROTOBUF_LIMIT = (2 << 30) - 1
# How external data files are opened: read-only, and never waiting (a FIFO where a file should be is refused as
# no regular file, not waited on for a writer)
OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(frozen=True)
class ExternalRef:
    """Where one tensor's bytes are: `location` (a name of ExternalData's files), offset and length."""

    tensor: str
    location: str
    offset: int
    length: int | None  # None: to the end of the file


def external_ref(t: TensorProto) -> ExternalRef | None:
    """The reference of a tensor whose data is external, or None for one with its data inline."""
    if t.data_location != TensorProto.EXTERNAL:
        return None
    entries = {e.key: e.value for e in t.external_data}
    try:
        offset = int(entries.get("offset", "0") or 0)
        length = int(entries["length"]) if entries.get("length") else None
    except ValueError:
        raise EpInvalidArgument(f"initializer {quoted(t.name)} has an external offset or length that is not a number")
    if offset < 0 or (length is not None and length < 0):
        raise EpInvalidArgument(f"initializer {quoted(t.name)} has a negative external offset or length")
    return ExternalRef(t.name, entries.get("location", ""), offset, length)


def _sparse(s: onnx.SparseTensorProto) -> tuple[TensorProto, TensorProto]:
    return s.values, s.indices


def _attribute_tensors(nodes, graphs: list[onnx.GraphProto]) -> Iterator[TensorProto]:
    """The tensors the nodes' attributes hold (Constant values, dense and sparse); their subgraphs go on `graphs`."""
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield from _sparse(attr.sparse_tensor)
            for sparse in attr.sparse_tensors:
                yield from _sparse(sparse)
            if attr.HasField("g"):
                graphs.append(attr.g)
            graphs.extend(attr.graphs)


def graph_tensors(graph: onnx.GraphProto, functions=()) -> Iterator[TensorProto]:
    """Every tensor that can hold data: initializers (dense and sparse) and tensor attributes, of the graph, of
    its nodes' subgraphs, and of the bodies of `functions` (and their subgraphs)."""
    graphs = [graph]
    yield from _attribute_tensors((node for f in functions for node in f.node), graphs)
    while graphs:
        g = graphs.pop()
        yield from g.initializer
        for sparse in g.sparse_initializer:
            yield from _sparse(sparse)
        yield from _attribute_tensors(g.node, graphs)


def model_tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    return graph_tensors(model.graph, model.functions)


def external_refs(model: onnx.ModelProto) -> list[tuple[TensorProto, ExternalRef]]:
    return [(t, r) for t in model_tensors(model) if (r := external_ref(t)) is not None]


def has_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == TensorProto.EXTERNAL for t in model_tensors(model))


def expected_bytes(t: TensorProto) -> int | None:
    """The bytes a tensor of this type and shape holds, where the element type has a fixed size."""
    try:
        return nbytes_of(tuple(t.dims), dtype_of(t.data_type))
    except EpInvalidArgument:
        return None


class ExternalFile:
    """A read-only open file: its descriptor, its size, and (on first use) one read-only shared mapping of it.
    Pages are read from disk when touched; untouched ones cost nothing."""

    def __init__(self, name: str, fd: int, size: int | None = None, label: str | None = None):
        self.name = name
        self.fd = fd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise EpInvalidArgument(f"external data {label or name!r} is not a regular file")
        self.size = st.st_size if size is None else size
        self.label = label or name  # how errors name it (a path on the application's side, else the name)
        self.identity = (st.st_dev, st.st_ino)
        # The same file, unchanged since: another open of it may stand for this one (a worker that has one
        # descriptor of it needs no second).
        self.version = (st.st_dev, st.st_ino, self.size, st.st_mtime_ns)
        self._map: mmap.mmap | None = None
        self._sha256: str | None = None
        self._lock = threading.Lock()  # guards _map and _sha256

    @classmethod
    def open(cls, name: str, path: str) -> "ExternalFile":
        fd = os.open(path, OPEN_FLAGS)
        return cls(name, fd, label=path)

    @classmethod
    def in_memory(cls, name: str, data: bytes) -> "ExternalFile":
        """A file's contents the application gave in memory, as an anonymous file (a memfd: a worker is handed
        it as any other, and it has no name anywhere), sealed against changing size as a worker others share
        requires."""
        fd = os.memfd_create("ephost-external", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, label=f"{name} (given in memory)")

    def view(self, offset: int, length: int) -> memoryview:
        """`length` bytes at `offset`, mapped (no copy)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise EpOutOfRange(f"bytes {offset}..{offset + length} are past the end of external data "
                               f"{self.label!r} ({self.size} bytes)")
        if length == 0:
            return memoryview(b"")
        with self._lock:
            if self._map is None:
                self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
            return memoryview(self._map)[offset: offset + length]

    def sha256(self) -> str:
        """The hash of the file's bytes (read once, by pread; kept): its name in a worker's blob cache."""
        with self._lock:
            if self._sha256 is None:
                import hashlib
                h = hashlib.sha256()
                offset = 0
                while offset < self.size:
                    chunk = os.pread(self.fd, min(8 << 20, self.size - offset), offset)
                    if not chunk:
                        raise EpOutOfRange(f"external data {self.label!r} became shorter than {self.size} bytes")
                    h.update(chunk)
                    offset += len(chunk)
                self._sha256 = h.hexdigest()
            return self._sha256

    def real_path(self) -> str | None:
        """The path this very file has in this process's view of the file system: the descriptor's link in
        /proc, trusted only where that path is still the same file (device and inode). None where it has none
        (deleted, or in another mount namespace)."""
        try:
            path = os.readlink(f"/proc/self/fd/{self.fd}")
            st = os.stat(path)
        except OSError:
            return None
        if not os.path.isabs(path) or (st.st_dev, st.st_ino) != self.identity:
            return None
        return path

    def close(self) -> None:
        with self._lock:
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:  # views of it are still alive: the mapping goes with the last of them
                    pass
                self._map = None
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def __del__(self):
        if getattr(self, "fd", -1) >= 0:
            try:
                self.close()
            except Exception:
                pass


class WorkerFile:
    """An external data file that lives in a worker's model directory (--model-dir), known here by its name,
    its size and its path there: only that worker reads it."""

    fd = -1

    def __init__(self, name: str, size: int, worker: str, path: str):
        self.name, self.size, self.worker, self.path = name, size, worker, path
        self.label = f"{path} in the model directory of worker {worker!r}"

    def _elsewhere(self):
        return EpFailedPrecondition(f"external data {self.label} is read by that worker only: the nodes that read "
                                    "it must run there")

    def view(self, offset: int, length: int) -> memoryview:
        raise self._elsewhere()

    def sha256(self) -> str:
        raise self._elsewhere()

    def real_path(self) -> None:
        return None

    def close(self) -> None:
        pass


class ExternalData:
    """A model's external data files by name, as its tensors' `location`s say."""

    def __init__(self, files: Mapping[str, ExternalFile]):
        self.files = dict(files)

    def __bool__(self) -> bool:
        return bool(self.files)

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def file(self, ref: ExternalRef) -> ExternalFile:
        try:
            return self.files[ref.location]
        except KeyError:
            raise EpInvalidArgument(f"initializer {quoted(ref.tensor)} names external data {quoted(ref.location)}, "
                                    "which is not among the model's files") from None

    def check(self, model: onnx.ModelProto) -> None:
        """Every external tensor of `model` names one of these files and lies inside it, with the bytes its
        type and shape need; else a typed error naming the tensor and the file."""
        for t, ref in external_refs(model):
            f = self.file(ref)
            length = f.size - ref.offset if ref.length is None else ref.length
            if ref.offset > f.size:
                raise EpOutOfRange(f"initializer {quoted(ref.tensor)}: offset {ref.offset} is past the end of "
                                   f"external data {f.label!r} ({f.size} bytes)")
            if ref.offset + length > f.size:
                raise EpOutOfRange(f"initializer {quoted(ref.tensor)}: external data {f.label!r} is {f.size} bytes, "
                                   f"too short for {length} bytes at offset {ref.offset} (truncated?)")
            need = expected_bytes(t)
            if need is not None and need != length:
                raise EpInvalidArgument(f"initializer {quoted(ref.tensor)} of shape {list(t.dims)} needs {need} bytes; "
                                        f"its external data in {f.label!r} is {length}")

    def array(self, t: TensorProto) -> np.ndarray:
        """The tensor's value over the mapping of its file: read-only, no copy."""
        ref = external_ref(t)
        f = self.file(ref)
        length = f.size - ref.offset if ref.length is None else ref.length
        dtype = dtype_of(t.data_type).newbyteorder("<")
        return np.frombuffer(f.view(ref.offset, length), dtype).reshape(tuple(t.dims))

    def inlined(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of `model` with the bytes of its external tensors inside it (a copy of each: for models, or
        partitions, small enough to be one protobuf)."""
        out = onnx.ModelProto()
        out.CopyFrom(model)
        total = 0
        for t, ref in external_refs(out):
            data = bytes(self.array(t).data)
            total += len(data)
            if total > PROTOBUF_LIMIT:
                raise EpInvalidArgument("the partition's initializers are over 2 GiB: they cannot be put inside "
                                        "one protobuf")
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
            t.raw_data = data
        return out

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def path_inside(base: str, location: str) -> str | None:
    """The path of `location` under `base`, or None where it would leave it (absolute, `..`, a link out)."""
    if not location or os.path.isabs(location) or "\0" in location:
        return None
    path = os.path.normpath(os.path.join(base, location))
    real_base = os.path.realpath(base)
    if os.path.commonpath([real_base, os.path.realpath(path)]) != real_base:
        return None
    return path


def open_external_data(model: onnx.ModelProto, base_dir: str | None, what: str,
                       in_memory: Mapping[str, bytes] | None = None) -> ExternalData | None:
    """Open, read-only, every file the model's external tensors name (relative to `base_dir`, never outside
    it; those `in_memory` gives by location, from there), and check every reference against the files' sizes.
    Nothing is read. None where it has none."""
    refs = external_refs(model)
    if not refs:
        return None
    in_memory = in_memory or {}
    files: dict[str, ExternalFile] = {}
    try:
        for t, ref in refs:
            if ref.location in files:
                continue
            if ref.location in in_memory:
                files[ref.location] = ExternalFile.in_memory(ref.location, in_memory[ref.location])
                continue
            if base_dir is None:
                raise EpInvalidArgument(f"{what} keeps initializer {ref.tensor!r} in external file {ref.location!r}, "
                                        "and bytes do not say where they were loaded from: give the model's path, "
                                        "or the file's contents (add_external_initializers_from_files_in_memory)")
            path = path_inside(base_dir, ref.location)
            if path is None:
                raise EpInvalidArgument(f"initializer {ref.tensor!r} of {what} names external data "
                                        f"{ref.location!r}, which is outside the model's directory")
            try:
                files[ref.location] = ExternalFile.open(ref.location, path)
            except FileNotFoundError:
                raise EpNoSuchFile(f"initializer {ref.tensor!r} of {what}: its external data file {path!r} does "
                                   "not exist") from None
            except IsADirectoryError:
                raise EpInvalidArgument(f"initializer {ref.tensor!r} of {what}: its external data {path!r} is "
                                        "a directory") from None
            except OSError as e:
                raise EpInvalidArgument(f"initializer {ref.tensor!r} of {what}: cannot open its external data "
                                        f"file {path!r}: {e.strerror}") from None
        data = ExternalData(files)
        data.check(model)
        return data
    except BaseException:
        for f in files.values():
            f.close()
        raise


def check_inline_size(model: onnx.ModelProto) -> None:
    """A model held in memory whose bytes are over protobuf's 2 GiB cannot be sent (or serialized) at all: say so,
    and what to do instead, before anything tries."""
    try:
        size = model.ByteSize()
    except Exception:  # some protobuf runtimes refuse to even count past the limit
        size = PROTOBUF_LIMIT + 1
    if size > PROTOBUF_LIMIT:
        raise EpInvalidArgument(f"the model is {size} bytes with its weights inside: a protobuf over 2 GiB cannot be "
                                "serialized; save it with its weights as external data (onnx.save(model, path, "
                                "save_as_external_data=True)) and give its path")


def inline_tensors(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> None:
    """Put these values in place of the external data of the model's initializers of those names (the
    application gave them: ORT's add_external_initializers), checked against each initializer's type and shape."""
    initializers = {t.name: t for t in model.graph.initializer}
    for name, value in values.items():
        t = initializers.get(name)
        if t is None or t.data_location != TensorProto.EXTERNAL:
            raise EpNotFound(f"the model has no initializer {name!r} kept in an external file (given by "
                             "add_external_initializers)")
        value = np.ascontiguousarray(value)
        if value.dtype != dtype_of(t.data_type) or tuple(value.shape) != tuple(t.dims):
            raise EpInvalidArgument(f"initializer {name!r} is {list(t.dims)} of {dtype_of(t.data_type)}; the value "
                                    f"given for it is {list(value.shape)} of {value.dtype}")
        del t.external_data[:]
        t.data_location = TensorProto.DEFAULT
        t.raw_data = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes()


def load_model(path: str, inline: Mapping[str, np.ndarray] | None = None,
               in_memory: Mapping[str, bytes] | None = None) -> tuple[onnx.ModelProto, ExternalData | None]:
    """The model at `path`, its graph only: external tensors stay references, their files opened read-only
    (and checked) but not read. `inline`: values given for external initializers (inline_tensors); `in_memory`:
    contents given for external files, by location."""
    what = f"model file {path!r}"
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise EpNoSuchFile(f"{what} does not exist") from None
    except OSError as e:
        raise EpInvalidArgument(f"{what} cannot be read: {e.strerror}") from None
    if size > PROTOBUF_LIMIT:
        raise EpInvalidArgument(f"{what} is {size} bytes: a protobuf over 2 GiB cannot be parsed; save the model "
                                "with its weights as external data (onnx.save(model, path, "
                                "save_as_external_data=True))")
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:
        raise EpInvalidModel(f"{what} is not a readable ONNX model ({type(e).__name__}: {e})") from None
    if inline:
        inline_tensors(model, inline)
    return model, open_external_data(model, os.path.dirname(os.path.abspath(path)), what, in_memory)


def model_key(data_sha256: str, files: Mapping[str, tuple[int, int]] | None = None) -> str:
    """How a worker knows a model it was sent (ModelRef.sha256): the hash of its bytes or, where it has
    external data, the hash of that and of which file (handle, size) each name stands for."""
    if not files:
        return data_sha256
    import hashlib
    spec = ";".join(f"{name}={handle}:{nbytes}" for name, (handle, nbytes) in sorted(files.items()))
    return hashlib.sha256(f"{data_sha256}\0files\0{spec}".encode()).hexdigest()


def on_disk(model: onnx.ModelProto, external: ExternalData) -> tuple[onnx.ModelProto, str] | None:
    """For a runtime that opens external data files itself (ONNX Runtime maps them): a copy of `model` whose
    external tensors' locations are paths, relative to one folder, of the very files `external` holds open,
    and that folder. The paths come from the descriptors (/proc/self/fd), checked to still be the same files,
    never from the model. None where a file has no such path here (deleted, another mount namespace)."""
    refs = external_refs(model)
    paths: dict[str, str] = {}
    for _, ref in refs:
        if ref.location not in paths:
            path = external.file(ref).real_path()
            if path is None:
                return None
            paths[ref.location] = path
    if not paths:
        return model, ""
    folder = os.path.commonpath([os.path.dirname(p) for p in paths.values()])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t, ref in external_refs(out):
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = os.path.relpath(paths[ref.location], folder)
    return out, folder
