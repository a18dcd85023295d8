"""ephost.client: the application side — Environment, EP devices, allocators, streams, worker supervision."""
from ephost.client.devices import EpDevice, SharedAllocator, SyncNotification, SyncStream
from ephost.client.environment import Environment
from ephost.client.iobinding import IOBinding
from ephost.client.model_source import ModelOnWorker
from ephost.client.session import InferenceSession
from ephost.client.session_io import NodeArg
from ephost.client.session_options import SessionOptions
from ephost.client.worker_stats import MethodStats, WorkerStats
from ephost.run_options import RunOptions

__all__ = ["Environment", "EpDevice", "SharedAllocator", "SyncNotification", "SyncStream", "InferenceSession",
           "SessionOptions", "RunOptions", "NodeArg", "IOBinding", "ModelOnWorker", "WorkerStats", "MethodStats"]
