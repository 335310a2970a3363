"""Run an app of ``cadence.server.app`` with uvicorn, shutting down in order.

Knows: uvicorn's ``Server`` and its shutdown sequence (stop listening, wait for
connections, cancel what is left, lifespan shutdown). Does not know routes or engines.

uvicorn alone would cancel a streaming response that outlives its grace period, and
the client would see a cut connection. Here shutdown first drains the engine worker:
requests in flight get ``shutdown_timeout`` seconds to finish, the rest are failed with
a 503 (non-streamed) or an error event and ``[DONE]`` (streamed), then uvicorn closes
connections that have nothing left to send.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from cadence.errors import CadenceError


class CadenceServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        worker = self.config.app.state.worker  # the app of cadence.server.app.create_app
        await asyncio.to_thread(worker.drain, self.shutdown_timeout)
        await super().shutdown(sockets)


def make_server(app, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
                log_level: str = "info") -> CadenceServer:
    """A server for ``app``; ``run()`` it (signals: SIGINT / SIGTERM start the shutdown),
    or ``run(sockets=[sock])`` on an already-bound socket."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + 5)
    return CadenceServer(config, shutdown_timeout)


def listen(host: str, port: int) -> socket.socket:
    """A bound socket for ``host:port`` (port 0: any free one), so that a port in use is a
    CadenceError (exit 2) before the model is loaded, and the real port is known.

    Made with protocol ``IPPROTO_TCP``, not 0: asyncio sets TCP_NODELAY only on accepted
    sockets whose ``proto`` says TCP, and accepted sockets inherit it from this one.
    Without it an answer on a reused connection can wait for Nagle's algorithm and the
    peer's delayed ACK: tens of milliseconds a request (``tests/test_server_hardening.py``
    times a reused connection)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CadenceError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock
