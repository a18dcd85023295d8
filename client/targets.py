"""What a registration's target names: an EP to launch, a worker to connect to, or an EP to host in-process."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from ephost.errors import EpInvalidArgument

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):\d{1,5}$")
_LIBRARY_SUFFIXES = (".so", ".dll", ".dylib")


@dataclass(frozen=True)
class Target:
    kind: Literal["launch", "connect", "inproc"]
    ep: str | None = None          # launch / inproc: the EP name
    address: str | None = None     # connect: a gRPC target string
    library: str | None = None     # launch: an ONNX Runtime plugin EP library
    tls: bool = False              # connect: over TLS (grpcs://)


def parse_target(target: str) -> Target:
    if not target:
        raise EpInvalidArgument("empty target; give an EP name, an address, or inproc:NAME")
    if target.startswith("inproc:"):
        return Target("inproc", ep=target[len("inproc:"):])
    if target.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return Target("connect", address=target)  # gRPC name syntax: several replicas behind one name
    if target.startswith("grpc://"):
        return Target("connect", address=target[len("grpc://"):])
    if target.startswith("grpcs://"):
        return Target("connect", address=target[len("grpcs://"):], tls=True)
    if _HOST_PORT.match(target):
        return Target("connect", address=target)
    if target.endswith(_LIBRARY_SUFFIXES) or os.sep in target:
        return Target("launch", ep="onnxruntime", library=os.path.abspath(target))
    return Target("launch", ep=target)
