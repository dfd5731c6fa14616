"""Loopback stand-in for the internet connectivity probe of SkyPilot's managed-jobs controller.

Before each status refresh the controller sends HEAD requests to https://8.8.8.8 and
https://1.1.1.1 (``_TEST_IP_LIST`` in ``sky/backends/backend_utils.py``); offline it loops
forever on "Network is not available" and the job stays RUNNING after Slurm finished it.
``gpudoor_testbed_probe`` (loaded from a ``.pth`` file) points that list here; this server
answers every HEAD/GET with 200 and an empty body.

Usage: python probe_server.py PORT
"""

import http.server
import sys


class _Handler(http.server.BaseHTTPRequestHandler):
    def _ok(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = _ok
    do_GET = _ok

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # one probe per controller poll: keep the log quiet


def main() -> None:
    port = int(sys.argv[1])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    print(f"probe server on http://127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
