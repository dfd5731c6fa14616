"""A moto S3 server for the transit tests, in its own process, listening on 127.0.0.1.

    python tests/transit/s3_test_server.py [-H 127.0.0.1] [-p PORT] [--exit-on-stdin-eof]

Prints the port it listens on (useful with ``-p 0``) as the first stdout line, then serves until
SIGTERM/SIGINT (or, with ``--exit-on-stdin-eof``, until its stdin closes, so it never outlives the
test session that started it).

It is ``moto.server.ThreadedMotoServer`` with two speed-ups. Moto's request dispatcher lists and
stats moto's ~180 package folders on every request (``moto.backends.list_of_moto_modules``); that
listing never changes while the server runs, so it is computed once. And moto answers each
ListObjectsV2 by scanning and sorting every key of the bucket, where S3 reads its sorted index: the
server keeps a sorted index of each bucket's key names (updated on every write and delete) and
answers a listing without a delimiter from it, so a listing costs what it returns, as on S3, and a
benchmark over a bucket of 100,000 objects measures the client, not moto. The answers are the same
(a test checks them against moto's own). Run in
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


def _index_listings() -> None:
    import bisect

    from moto.s3.models import FakeDeleteMarker, FakeTableStorageBucket, S3Backend
    from moto.s3.utils import _VersionedKeyStore as Store

    lock = threading.Lock()

    def index(store: Store) -> list[str]:  # under lock
        names = store.__dict__.get("_sorted_names")
        if names is None:
            names = store.__dict__["_sorted_names"] = sorted(dict.keys(store))
        return names

    def added(store: Store, key: str) -> None:
        with lock:
            names = index(store)
            i = bisect.bisect_left(names, key)
            if i == len(names) or names[i] != key:
                names.insert(i, key)

    def removed(store: Store, key: str) -> None:
        with lock:
            names = index(store)
            i = bisect.bisect_left(names, key)
            if i < len(names) and names[i] == key:
                del names[i]

    set_item, set_list, pop = Store.__setitem__, Store.setlist, Store.pop

    def __setitem__(self: Store, key: str, value: object) -> None:
        set_item(self, key, value)
        added(self, key)

    def setlist(self: Store, key: str, list_: object) -> None:
        set_list(self, key, list_)
        added(self, key)

    def pop_(self: Store, key: str) -> None:
        pop(self, key)
        removed(self, key)

    Store.__setitem__, Store.setlist, Store.pop = __setitem__, setlist, pop_  # type: ignore[method-assign]
    moto_list = S3Backend.list_objects_v2

    def list_objects_v2(self, bucket, prefix, delimiter, continuation_token, start_after, max_keys):  # type: ignore[no-untyped-def]
        if delimiter or isinstance(bucket, FakeTableStorageBucket):
            return moto_list(self, bucket, prefix, delimiter, continuation_token, start_after, max_keys)
        prefix = prefix or ""
        after = self._pagination_tokens.get(continuation_token) if continuation_token else start_after
        store, found = bucket.keys, []
        with lock:
            names = index(store)
            i = bisect.bisect_right(names, after) if after and after >= prefix else bisect.bisect_left(names, prefix)
        while len(found) <= max_keys:
            with lock:
                batch = names[i : i + max_keys + 1 - len(found)]
            if not batch:
                break
            i += len(batch)
            for name in batch:
                if not name.startswith(prefix):
                    i = len(names) + 1  # past the prefix: nothing after matches
                    break
                versions = dict.get(store, name)
                if versions and not isinstance(versions[-1], FakeDeleteMarker):
                    found.append(versions[-1])
            else:
                continue
            break
        return self._truncate_result(found, max_keys) if max_keys else ([], False, None)

    S3Backend.list_objects_v2 = list_objects_v2  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-H", "--host", default="127.0.0.1")
    ap.add_argument("-p", "--port", type=int, default=0)
    ap.add_argument("--exit-on-stdin-eof", action="store_true")
    args = ap.parse_args(argv)

    _speed_up_moto()
    _index_listings()
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
