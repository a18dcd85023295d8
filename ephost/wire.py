"""What both ends of the wire must agree on, defined once: the protocol version, the metadata keys a call
carries, message and chunk sizes, the structured reasons an error status may carry, and reading the files
(certificates, keys, tokens) that either side is pointed at."""
from __future__ import annotations

PROTOCOL = "ephost.v1"

# Every call after Worker.Hello carries the client id the worker handed out, under this metadata key.
CLIENT_ID_KEY = "ephost-client"

# Largest message either side sends or accepts; larger payloads travel in chunks or through shared memory.
MAX_MESSAGE = 1 << 30

# One message of a chunked transfer (Allocator.Write / Allocator.Read).
CHUNK_BYTES = 16 << 20

# The longest drain a worker grants calls under way when it stops (Worker.Shutdown's grace_s, --drain-grace-s).
MAX_GRACE_S = 600.0
# The fast lane: how long either end polls for the next frame before it sleeps (FrameReader), by default and
# at most.
SPIN_S = 500e-6
MAX_SPIN_S = 0.1
# The fast lane: how long a worker's send to a client that reads nothing may wait before the worker closes that
# connection (the call whose reply it is holds a call slot meanwhile), by default and at most.
SEND_TIMEOUT_S = 10.0
MAX_SEND_TIMEOUT_S = 3600.0

# A failed call may say *why* in its trailing metadata under this key, so that a peer can act on the reason
# without matching the message text. The values are the REASON_* constants below.
REASON_KEY = "ephost-reason"

# The worker does not know the client id the call carries (it restarted, or released the client after its
# lease ran out): say Hello again. Status FAILED_PRECONDITION.
REASON_UNKNOWN_CLIENT = "unknown-client"

# A fast-lane connection does not know the kept call a KEPT frame names (ephost/fastlane.py): the worker let it
# go to keep newer ones; send the whole Compute. Status NOT_FOUND.
REASON_UNKNOWN_KEPT_CALL = "unknown-kept-call"

# The worker refused the call as it drains (SIGTERM: it is shutting down): nothing of the call ran. Status
# UNAVAILABLE.
REASON_DRAINING = "draining"

# Kinds of bad input ONNX Runtime names with classes of their own (ephost.errors raises them as those classes
# too): a model that is no readable ONNX (ORT's InvalidProtobuf), a graph that is not valid (InvalidGraph), a
# file the caller named that does not exist (NoSuchFile). Status INVALID_ARGUMENT, INVALID_ARGUMENT, NOT_FOUND.
REASON_INVALID_MODEL = "invalid-model"
REASON_INVALID_GRAPH = "invalid-graph"
REASON_NO_SUCH_FILE = "no-such-file"


def read_file(path: str) -> bytes:
    """The bytes of a file an operator or user named (a certificate, a key, a token); a clear error if not."""
    from ephost.errors import EpInvalidArgument
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise EpInvalidArgument(f"cannot read {path}: {e.strerror}") from None
