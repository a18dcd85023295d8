"""ONNX's backend interface (onnx.backend.base.Backend) over ephost sessions, so that ONNX's own backend
test suite runs through ephost: `Backend.prepare(model, device, providers=[...], env=...)`."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from ephost.client.session import InferenceSession, SessionOptions


class EphostRep(BackendRep):
    def __init__(self, session: InferenceSession):
        self.session = session
        self._inputs = [i.name for i in session.get_inputs()]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, dict):
            feeds = inputs
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = dict(zip(self._inputs, inputs))
        return tuple(self.session.run(None, feeds))

    def close(self) -> None:
        self.session.close()


class EphostBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", *, env=None,
                providers: Sequence[Any] | None = None, sess_options: SessionOptions | None = None,
                **kwargs: Any) -> EphostRep:
        if not cls.supports_device(device):
            raise ValueError(f"ephost runs models on the CPU fallback and on its EPs; device {device!r} is not one")
        return EphostRep(InferenceSession(model, sess_options, env=env, providers=providers))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        rep = cls.prepare(model, device, **kwargs)
        try:
            return rep.run(inputs)
        finally:
            rep.close()

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper().startswith("CPU")


prepare = EphostBackend.prepare
run_model = EphostBackend.run_model
run_node = EphostBackend.run_node
supports_device = EphostBackend.supports_device
