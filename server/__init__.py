"""ephost.server: the worker process, gRPC servicers over any EP implementation."""
