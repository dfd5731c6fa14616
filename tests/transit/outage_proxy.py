"""A TCP proxy on 127.0.0.1 in front of a service, which a test can take away and bring back: while it is
down, its port refuses connections and the open ones go silent (nothing more is forwarded, and no reset
reaches the client: a socket another thread is reading is not released by ``close``), as when a server's
network goes away."""

from __future__ import annotations

import contextlib
import socket
import threading


class OutageProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (host, port) while up."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self.up()

    def up(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for conn in conns:  # nothing more is forwarded; the threads reading them end on their next read
            with contextlib.suppress(OSError):
                conn.close()

    @contextlib.contextmanager
    def outage(self, seconds: float):
        """Down now, up again ``seconds`` later (in the background); yields at once."""
        self.down()
        timer = threading.Timer(seconds, self.up)
        timer.start()
        try:
            yield
        finally:
            timer.join()

    def close(self) -> None:
        self.down()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._conns |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns -= {src, dst}
