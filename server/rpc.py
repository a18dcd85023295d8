"""The one place where servicer methods become gRPC calls: typed errors become statuses, every call is
counted, and anything unexpected is logged and answered with INTERNAL while the worker keeps serving."""
from __future__ import annotations

import functools
import logging
import time

import grpc

from ephost.errors import REASON_KEY, EpError

log = logging.getLogger(__name__)


def rpc(method):
    """Decorate a servicer method `(self, request, context)`; `self.state` is the WorkerState."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, request, context):
        state = self.state
        if state.draining.is_set():  # calls under way finish; new ones are turned away
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining (shutting down); try another")
        start = time.perf_counter()
        ok = False
        with state.in_flight_lock:
            state.in_flight += 1
        try:
            reply = method(self, request, context)
            ok = True
            return reply
        except EpError as e:
            error = (e.code, str(e))
            reason = getattr(e, "reason", "")
            if reason:
                context.set_trailing_metadata(((REASON_KEY, reason),))
        except Exception as e:  # a bug or a vendor failure: report it, keep serving
            log.exception("%s.%s failed", type(self).__name__, name)
            error = (grpc.StatusCode.INTERNAL, f"{name} failed inside the worker: {type(e).__name__}: {e}")
        finally:
            with state.in_flight_lock:
                state.in_flight -= 1
            state.stats.record_call(f"{self.SERVICE}/{name}", time.perf_counter() - start, ok)
        context.abort(*error)

    return call
