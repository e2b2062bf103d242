"""A small real HTTP server on loopback that plays an OpenAI-compatible judge badly or well, for the
judge client's tests: it answers from a script of behaviours, records what it was sent, and can die."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# A behaviour takes the request body and returns (status, answer text or error body, extra headers);
# "sleep:<s>" answers after <s> seconds, "close" drops the connection without an answer.
Behaviour = Callable[[dict[str, Any]], tuple[int, str, dict[str, str]]] | str


def answer(text: str) -> Behaviour:
    return lambda body: (200, text, {})


def status(code: int, headers: dict[str, str] | None = None) -> Behaviour:
    return lambda body: (code, json.dumps({"error": {"message": f"scripted {code}"}}), headers or {})


class ScriptedJudge:
    """``script`` is consumed one behaviour per request; ``default`` answers once it is empty."""

    def __init__(self, script: list[Behaviour] | None = None, default: Behaviour | None = None):
        self.script = list(script or [])
        self.default = default or answer("yes")
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # /health
                self.send_response(200)
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.requests.append(body)
                    judge.headers.append(dict(self.headers))
                    behaviour = judge.script.pop(0) if judge.script else judge.default
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                if isinstance(behaviour, str) and behaviour.startswith("sleep:"):
                    time.sleep(float(behaviour.split(":")[1]))
                    behaviour = judge.default
                with judge.lock:  # before answering: the client may send its next request at once
                    judge.in_flight -= 1
                self._answer(behaviour, body)

            def _answer(self, behaviour: Behaviour, body: dict[str, Any]) -> None:
                if behaviour == "close":
                    self.close_connection = True
                    self.connection.close()
                    return
                code, text, headers = behaviour(body)
                payload = (
                    text
                    if code != 200
                    else json.dumps(
                        {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
                    )
                )
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload.encode())))
                self.end_headers()
                self.wfile.write(payload.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def die(self) -> None:
        """Stops listening and closes the socket: later requests find the port refused."""
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ScriptedJudge:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.die()
