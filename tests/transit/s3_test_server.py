"""A moto S3 server for the transit tests, in its own process, listening on 127.0.0.1.

    python tests/transit/s3_test_server.py [-H 127.0.0.1] [-p PORT] [--exit-on-stdin-eof]

Prints the port it listens on (useful with ``-p 0``) as the first stdout line, then serves until
SIGTERM/SIGINT (or, with ``--exit-on-stdin-eof``, until its stdin closes, so it never outlives the
test session that started it).

It is ``moto.server.ThreadedMotoServer`` with one speed-up: moto's request dispatcher lists and
stats moto's ~180 package folders on every request (``moto.backends.list_of_moto_modules``); that
listing never changes while the server runs, so it is computed once. The S3 API is untouched. Run in
its own process, the server and the test client also stop competing for one GIL: on a 2-core
machine this roughly halves the time of the many-small-files tests compared with an in-process
``ThreadedMotoServer`` or a stock ``moto_server``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def _speed_up_moto() -> None:
    import moto.backends as backends

    modules = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: iter(modules)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-H", "--host", default="127.0.0.1")
    ap.add_argument("-p", "--port", type=int, default=0)
    ap.add_argument("--exit-on-stdin-eof", action="store_true")
    args = ap.parse_args(argv)

    _speed_up_moto()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address=args.host, port=args.port, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    if args.exit_on_stdin_eof:

        def watch_stdin() -> None:
            sys.stdin.read()
            done.set()

        threading.Thread(target=watch_stdin, daemon=True).start()
    while not done.wait(0.5):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
