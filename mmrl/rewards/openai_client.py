"""A small client for OpenAI-compatible chat endpoints (vLLM's server, hosted APIs), made for judging.

``ChatClient.complete_many`` sends many chat requests with at most ``max_concurrency`` in flight and
returns, in order, each answer's text or a :class:`~mmrl.rewards.source.SampleFailure` naming why that
request has none. A request is retried, waiting ``backoff_s`` and doubling the wait each time (an HTTP
``Retry-After`` header wins, up to ``MAX_RETRY_AFTER_S``), after a timeout, a lost or refused connection,
HTTP 429 or any 5xx; other 4xx answers fail that request at once. 401, 403 and 404 mean the endpoint,
the key or the model name is wrong for every request: they raise :class:`RewardSourceError`.

The API key is read from an environment variable by the caller and held only in the request headers;
no message, exception or log line contains it. :class:`ResponseCache` keeps answers in a sqlite file
keyed by the request body (model, messages with their images, sampling settings; not the URL, so a
resumed run whose served judge got another port still finds them).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmrl.rewards.source import RewardSourceError, SampleFailure

RETRY_STATUS = (429,)  # plus every 5xx
FATAL_STATUS = {401: "Unauthorized", 403: "Forbidden", 404: "Not Found"}
MAX_RETRY_AFTER_S = 60.0  # an endpoint asking for longer waits that long at most per retry
_MAX_BODY_CHARS = 200  # of an error answer, in a failure reason


class ResponseCache:
    """Answers by request, in a sqlite file shared by the processes of a run (WAL mode, one writer at a
    time; a reader never waits)."""

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False)
        with self._lock, self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, answer TEXT)")

    @staticmethod
    def key(body: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT answer FROM answers WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def put(self, key: str, answer: str) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO answers VALUES (?, ?)", (key, answer))

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass
class ClientStats:
    """Counts since the client was made: what was asked, answered from the cache, retried, failed."""

    requests: int = 0
    cache_hits: int = 0
    retries: int = 0
    failures: int = 0


class ChatClient:
    """POSTs ``{base_url}/chat/completions``; see the module docstring for retries and failures."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        backoff_s: float = 1.0,
        cache: ResponseCache | None = None,
        api_key_env: str = "",
    ):
        import httpx

        self.url = base_url.rstrip("/") + "/chat/completions"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._http = httpx.Client(headers=headers, timeout=timeout_s, limits=limits)
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.cache = cache
        self.api_key_env = api_key_env  # named in messages about the key; the key itself never is
        self.stats = ClientStats()
        self._stats_lock = threading.Lock()

    def complete_many(self, bodies: list[dict[str, Any]]) -> list[str | SampleFailure]:
        """The answer text (or failure) of each request body, in order; cached answers are not asked."""
        if not bodies:
            return []
        with ThreadPoolExecutor(min(self.max_concurrency, len(bodies)), "judge-request") as pool:
            return list(pool.map(self.complete, bodies))

    def complete(self, body: dict[str, Any]) -> str | SampleFailure:
        self._count("requests")
        key = ResponseCache.key(body) if self.cache is not None else ""
        if self.cache is not None and (answer := self.cache.get(key)) is not None:
            self._count("cache_hits")
            return answer
        result = self._post_with_retries(body)
        if isinstance(result, SampleFailure):
            self._count("failures")
        elif self.cache is not None:
            self.cache.put(key, result)
        return result

    def _post_with_retries(self, body: dict[str, Any]) -> str | SampleFailure:
        import httpx

        problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._count("retries")
            wait = self.backoff_s * 2**attempt
            try:
                response = self._http.post(self.url, json=body)
            except httpx.TimeoutException:
                problem = f"no answer within timeout_s={self.timeout_s:g}"
            except httpx.TransportError as err:  # refused, reset, closed mid-answer: the server died
                problem = f"connection failed ({type(err).__name__}: {str(err)[:_MAX_BODY_CHARS]})"
            else:
                status = response.status_code
                if status == 200:
                    return self._answer_text(response)
                if status in FATAL_STATUS:
                    raise RewardSourceError(self._fatal_message(status, response.text))
                problem = f"HTTP {status}: {response.text[:_MAX_BODY_CHARS]}"
                if status not in RETRY_STATUS and status < 500:
                    return SampleFailure(problem)  # the request itself is wrong: asking again won't help
                wait = _retry_after(response, wait)
            if attempt < self.max_retries:
                time.sleep(wait)
        return SampleFailure(f"{problem} (after {self.max_retries + 1} tries)")

    def _count(self, name: str) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _answer_text(self, response: Any) -> str | SampleFailure:
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return SampleFailure(
                f"answer without choices[0].message.content: {response.text[:_MAX_BODY_CHARS]}"
            )
        return content if isinstance(content, str) else ""

    def _fatal_message(self, status: int, text: str) -> str:
        hint = {
            401: f"the API key in ${self.api_key_env} was refused"
            if self.api_key_env
            else "it wants an API "
            "key: set worker.reward.judge.api_key_env to the environment variable that holds it",
            403: f"the API key in ${self.api_key_env or '(none)'} may not use this model",
            404: "check base_url (it ends before /chat/completions, e.g. http://host:8000/v1) and the model name",
        }[status]
        return (
            f"judge endpoint {self.url} answered HTTP {status} {FATAL_STATUS[status]} ({hint}): "
            f"{text[:_MAX_BODY_CHARS]}"
        )

    def close(self) -> None:
        self._http.close()


def _retry_after(response: Any, default: float) -> float:
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(response.headers.get("retry-after", ""))))
    except ValueError:
        return default
