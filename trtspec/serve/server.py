"""`trtspec serve`: warm the engines up, then open the port and run uvicorn until SIGTERM / Ctrl-C.

The port opens only once the engines are loaded and have run `ar` and the default strategy (first
calls pay one-off costs: ONNX Runtime's allocations, torch's kernels). SIGTERM or Ctrl-C drains: the
listening socket closes, /health and new API calls answer 503, running requests finish (at most
`drain_timeout` seconds, after which they are cancelled), then the scheduler stops and the process
exits with status 0 (after SIGTERM or Ctrl-C alike: a drained server has succeeded).
"""
from __future__ import annotations

import signal
import socket
import threading

import uvicorn

from ..errors import TrtspecError
from .app import Service, make_app


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, svc: Service):
        super().__init__(config)
        self.svc = svc

    def handle_exit(self, sig, frame) -> None:
        self.svc.draining = True
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))      # reserved (a busy port fails before any loading), not yet listening
    except OSError as e:
        sock.close()
        raise TrtspecError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port or --host") from None
    return sock


def serve(svc: Service, sock: socket.socket, drain_timeout: float, log, log_level: str = "warning") -> None:
    """Warm up, then listen on `sock` (from `bind`) and serve until SIGTERM / Ctrl-C."""
    log(f"warmed up in {svc.engine.warm_up():.1f}s")
    host, port = sock.getsockname()[:2]
    try:
        sock.listen(2048)            # after the warm-up: a client never meets a cold engine
    except OSError as e:             # another process began listening on it meanwhile
        raise TrtspecError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port") from None
    config = uvicorn.Config(make_app(svc), log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                            access_log=log_level in ("info", "debug", "trace"))
    shown = f"[{host}]" if ":" in host else host
    log(f"serving {svc.model!r} ({svc.backend}, default strategy {svc.engine.strategy}, "
        f"{len(svc.engine.gen.slots)} slots) on http://{shown}:{port}/v1")
    # uvicorn drains on SIGTERM / SIGINT, then raises the signal again for the handler it found: make
    # those no-ops, so a drained server exits with status 0 instead of being killed (SIGTERM) or
    # interrupted (SIGINT) by the re-raised signal.
    main = threading.current_thread() is threading.main_thread()
    sigs = (signal.SIGTERM, signal.SIGINT) if main else ()
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in sigs}
    try:
        _Server(config, svc).run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log("stopped")
