"""Serve a checkpoint over HTTP as a demo: ``python -m workloads.serve``.

Environment:
    CHECKPOINT_URI: a checkpoint folder holding ``model.pt`` (or the ``model.pt`` URI itself).
    PORT: TCP port to listen on.
    SERVE_HOST: address to bind (default 127.0.0.1; use 0.0.0.0 to be reachable from outside).

Endpoints:
    ``GET /healthz``: 200 ``ok``.
    ``GET /?color=red&shape=circle`` (both optional, random when left out): draws a fresh image of
    that colour and shape and answers {"input": {"color", "shape", "index"}, "prediction":
    "a red circle", "checkpoint": CHECKPOINT_URI}.

SIGTERM or SIGINT stops the server cleanly (exit 0).
"""

from __future__ import annotations

import json
import random
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch

from gpudoor_pipelines.data.synthetic import COLORS, SHAPES, caption_text, generate_image
from workloads.config import ConfigError, env_int, env_str, run_main
from workloads.model import ShapeColorNet, image_to_input, load_model, pick_device, predict


class Demo:
    """The loaded model and the one thing the demo does with it."""

    def __init__(
        self, model: ShapeColorNet, vocab: dict[str, list[str]], device: torch.device, checkpoint_uri: str
    ) -> None:
        self.model, self.vocab, self.device, self.checkpoint_uri = model, vocab, device, checkpoint_uri
        self._lock = threading.Lock()  # one forward pass at a time: the model is tiny, contention is not

    def sample(self, color: str | None, shape: str | None) -> dict[str, Any]:
        """Draw an image of (colour, shape), random where None, and caption it with the model."""
        color = color or random.choice(list(COLORS))
        shape = shape or random.choice(SHAPES)
        index = random.randrange(1_000_000)
        png, color, shape = generate_image(index, color=color, shape=shape)
        with self._lock:
            color_pred, shape_pred = predict(self.model, image_to_input(png).unsqueeze(0).to(self.device))
        prediction = caption_text(self.vocab["colors"][int(color_pred[0])], self.vocab["shapes"][int(shape_pred[0])])
        return {
            "input": {"color": color, "shape": shape, "index": index},
            "prediction": prediction,
            "checkpoint": self.checkpoint_uri,
        }


def make_handler(demo: Demo) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to ``demo``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            url = urlsplit(self.path)
            if url.path == "/healthz":
                self._send(200, b"ok", "text/plain")
                return
            if url.path != "/":
                self._send(404, json.dumps({"error": f"no such path {url.path}"}).encode())
                return
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            color, shape = query.get("color"), query.get("shape")
            if color is not None and color not in COLORS or shape is not None and shape not in SHAPES:
                error = f"color must be one of {list(COLORS)} and shape one of {list(SHAPES)}"
                self._send(400, json.dumps({"error": error}).encode())
                return
            self._send(200, json.dumps(demo.sample(color, shape)).encode())

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def main() -> int:
    """Load the checkpoint and serve until SIGTERM/SIGINT."""
    checkpoint_uri = env_str("CHECKPOINT_URI")
    port = env_int("PORT")
    host = env_str("SERVE_HOST", "127.0.0.1")
    if not 0 <= port < 65536:
        raise ConfigError(f"PORT must be 0..65535, got {port}")

    device = pick_device()
    model, state = load_model(checkpoint_uri, device)
    server = ThreadingHTTPServer((host, port), make_handler(Demo(model, state["vocab"], device, checkpoint_uri)))
    server.daemon_threads = True

    def stop(signum: int, _frame: FrameType | None) -> None:
        print(f"received {signal.Signals(signum).name}; shutting down", flush=True)
        # shutdown() waits for serve_forever() to return, so it cannot run on the serving thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    bound_host, bound_port = server.server_address[:2]
    print(f"serving on http://{bound_host}:{bound_port} (checkpoint step {state['step']}, {device})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
