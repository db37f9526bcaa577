"""The target's answers from OpenAI-compatible servers: many endpoints, many requests in flight, exact token ids.

Every endpoint gets `concurrency` workers that take prompts from one shared queue, so a faster server takes more
of the work and an unreachable one none: it leaves the rotation with one log line, one of its workers tries it
again after a growing pause, and it rejoins with another line. A request whose answer fails (an error status, no
answer within `timeout_s`) is sent again up to `retries` times, to whichever endpoint is free.

Two dialects. vLLM and SGLang take the prompt as token ids and return the answer's ids (`return_token_ids`), so
the drafter trains on exactly the tokens the target produced. A strict OpenAI server (`transformers serve`)
rejects those fields with a 4xx: that endpoint then gets the prompt as text and its answers are tokenized with the
target's tokenizer (counted as `from_text`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from dflash_stream.config import ConfigError, GenerationConfig
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger

log = get_logger(__name__)

FIRST_PAUSE_S, LONGEST_PAUSE_S = 2.0, 60.0
"""Pause before an unreachable endpoint is tried again, doubled at each failed try up to the longest."""
FAILURES_TO_PAUSE = 3
"""Failed answers in a row (errors, timeouts) after which an endpoint that still accepts connections pauses."""
CONNECT_TIMEOUT_S = 10.0


class RegenerationError(DFlashError):
    """The servers cannot finish the phase: every endpoint unreachable for too long, or an endpoint that does not
    serve completions."""


@dataclass(frozen=True)
class Prompt:
    key: int
    """The sample id."""
    ids: list[int]
    max_tokens: int


@dataclass
class Answer:
    key: int
    tokens: list[int] | None
    """The answer's ids, ending with the stop token when the target ended it; None for an error."""
    finish: str
    """stop, length (cut at max_tokens) or error."""
    endpoint: str
    from_text: bool = False
    """Tokenized from the returned text: the server gave no ids."""
    retokenize_differs: bool = False
    """The server's ids differ from what tokenizing their own text gives (what a text-only server would lose)."""
    error: str | None = None


class _Unreachable(Exception):
    """No connection, or the connection broke: the endpoint, not the request, is at fault."""


class _Failed(Exception):
    """The server answered this request with an error, or not in time."""


class _Rejected(Exception):
    """The server refused this request (4xx): sending it again would not help."""


@dataclass
class _Job:
    prompt: Prompt
    attempts: int = 0


@dataclass
class Endpoint:
    url: str
    model: str | None = None
    dialect: str = "ids"
    """ids (prompt and answer as token ids) or text (a strict OpenAI server)."""
    up: bool = True
    probing: bool = False
    retry_at: float = 0.0
    pause: float = FIRST_PAUSE_S
    down_since: float | None = None
    failures_in_row: int = 0
    answers: int = 0
    tokens: int = 0
    errors: int = 0
    outages: int = 0

    def stats(self) -> dict[str, Any]:
        return {"answers": self.answers, "tokens": self.tokens, "errors": self.errors, "outages": self.outages,
                "dialect": self.dialect, "model": self.model}


class CompletionClient:
    """Sends prompts to the endpoints of `data.generation` and hands each answer to a callback as it comes."""

    def __init__(self, gen: GenerationConfig, tokenizer, stop_ids: set[int], concurrency: int | None = None
                 ) -> None:
        if not stop_ids:
            raise ConfigError("target.model: the target names no end-of-sequence token; regeneration cannot tell "
                              "an ended answer from a cut one")
        self.gen, self.tokenizer, self.stop_ids = gen, tokenizer, stop_ids
        self.concurrency = concurrency or gen.concurrency
        self.default_stop = tokenizer.eos_token_id if tokenizer.eos_token_id in stop_ids else min(stop_ids)
        self.endpoints = [Endpoint(url) for url in gen.endpoints]
        self.headers = {"Content-Type": "application/json"}
        if gen.api_key_env:
            key = os.environ.get(gen.api_key_env)
            if not key:
                raise ConfigError(f"data.generation.api_key_env: the environment variable {gen.api_key_env} is not "
                                  "set (it should hold the servers' API key)")
            self.headers["Authorization"] = f"Bearer {key}"

    def run(self, prompts: Iterable[Prompt], on_answer: Callable[[Answer], None]) -> None:
        """Ask for every prompt (in order, `concurrency` at a time per endpoint); returns when each has an answer
        or an error. Raises RegenerationError when no endpoint can be reached for `give_up_s`."""
        asyncio.run(self._run(list(prompts), on_answer))

    # -- the event loop ---------------------------------------------------------------------------------------

    async def _run(self, prompts: list[Prompt], on_answer: Callable[[Answer], None]) -> None:
        if not prompts:
            return
        queue: asyncio.Queue[_Job] = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(_Job(prompt))
        timeout = httpx.Timeout(self.gen.timeout_s, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=self.concurrency * len(self.endpoints) + len(self.endpoints),
                              max_keepalive_connections=self.concurrency * len(self.endpoints))
        fatal: list[BaseException] = []
        stop = asyncio.Event()  # set with the first fatal error: every worker ends
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=self.headers) as http:
            await asyncio.gather(*(self._first_contact(http, ep) for ep in self.endpoints))
            workers = [asyncio.create_task(self._worker(http, ep, queue, on_answer, fatal, stop))
                       for ep in self.endpoints for _ in range(self.concurrency)]
            waits = [asyncio.create_task(queue.join()), asyncio.create_task(stop.wait()),
                     asyncio.create_task(self._watchdog(fatal, stop))]
            try:
                await asyncio.wait(waits[:2], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in workers + waits:
                    task.cancel()
                await asyncio.gather(*workers, *waits, return_exceptions=True)
        if fatal:
            raise fatal[0]

    async def _first_contact(self, http: httpx.AsyncClient, ep: Endpoint) -> None:
        """Learn each endpoint's model before the work starts; one that cannot be reached starts out of rotation
        (its first request asks again)."""
        try:
            await self._introduce(http, ep)
        except _Unreachable as err:
            self._mark_down(ep, str(err))

    async def _introduce(self, http: httpx.AsyncClient, ep: Endpoint) -> None:
        """The served model's name, from /models (checked against data.generation.model when that is set)."""
        try:
            response = await http.get(f"{ep.url}/models", timeout=min(CONNECT_TIMEOUT_S, self.gen.timeout_s))
        except httpx.HTTPError as err:
            raise _Unreachable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
        if response.status_code == 404:
            raise ConfigError(f"data.generation.endpoints: {ep.url}/models not found (HTTP 404); give the base URL "
                              "the server's OpenAI API lives under, such as http://host:8000/v1")
        served = []
        if response.status_code == 200:
            served = [m.get("id") for m in response.json().get("data", []) if m.get("id")]
        if self.gen.model is not None:
            if served and self.gen.model not in served:
                raise ConfigError(f"data.generation.model: '{self.gen.model}' is not served at {ep.url}; it serves "
                                  f"{', '.join(served)}")
            ep.model = self.gen.model
        elif served:
            ep.model = served[0]
        else:
            raise ConfigError(f"data.generation.model: {ep.url}/models lists no model "
                              f"(HTTP {response.status_code}); name the served model")

    async def _watchdog(self, fatal: list[BaseException], stop: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(1.0)
            downs = [ep.down_since for ep in self.endpoints if not ep.up]
            if len(downs) == len(self.endpoints) and time.monotonic() - max(downs) > self.gen.give_up_s:
                fatal.append(RegenerationError(
                    f"no endpoint answered for {self.gen.give_up_s:.0f} s (data.generation.give_up_s): "
                    f"{', '.join(ep.url for ep in self.endpoints)}; start the servers and run again: what is "
                    "answered is kept"))
                stop.set()
                return

    async def _worker(self, http: httpx.AsyncClient, ep: Endpoint, queue: asyncio.Queue[_Job],
                      on_answer: Callable[[Answer], None], fatal: list[BaseException], stop: asyncio.Event) -> None:
        try:
            while True:
                await self._one_job(http, ep, queue, on_answer)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a server that cannot do the work, or the cache cannot be written: all stop
            fatal.append(err)
            stop.set()

    async def _one_job(self, http: httpx.AsyncClient, ep: Endpoint, queue: asyncio.Queue[_Job],
                       on_answer: Callable[[Answer], None]) -> None:
        probe = await self._turn(ep)
        job = await queue.get()
        try:
            answer = await self._ask(http, ep, job.prompt)
        except _Unreachable as err:
            self._mark_down(ep, str(err), probe)
            queue.put_nowait(job)  # not the request's fault: it keeps its tries
        except _Failed as err:
            job.attempts += 1
            ep.failures_in_row += 1
            if ep.failures_in_row >= FAILURES_TO_PAUSE or probe:
                self._mark_down(ep, f"{ep.failures_in_row} failed answers in a row, the last: {err}", probe)
            if job.attempts > self.gen.retries:
                ep.errors += 1
                log.warning("sample %d: no answer after %d tries (data.generation.retries %d), the last from %s: %s",
                            job.prompt.key, job.attempts, self.gen.retries, ep.url, err)
                on_answer(Answer(job.prompt.key, None, "error", ep.url, error=str(err)))
            else:
                queue.put_nowait(job)
        except _Rejected as err:
            ep.errors += 1
            self._back_up(ep)
            log.warning("sample %d: %s refused the request: %s", job.prompt.key, ep.url, err)
            on_answer(Answer(job.prompt.key, None, "error", ep.url, error=str(err)))
        else:
            self._back_up(ep)
            ep.answers += 1
            ep.tokens += len(answer.tokens or [])
            on_answer(answer)
        finally:
            if probe:
                ep.probing = False
        queue.task_done()

    async def _turn(self, ep: Endpoint) -> bool:
        """Wait until this worker may send to `ep`: at once while it is up; while it is down, one worker tries it
        again once its pause is over (returns True: that worker probes)."""
        while True:
            if ep.up:
                return False
            now = time.monotonic()
            if not ep.probing and now >= ep.retry_at:
                ep.probing = True
                return True
            await asyncio.sleep(min(1.0, max(0.05, ep.retry_at - now)))

    def _mark_down(self, ep: Endpoint, reason: str, probe: bool = False) -> None:
        """Out of rotation; a failed probe doubles the pause (the other requests in flight when it went down
        fail too, and change nothing)."""
        now = time.monotonic()
        if ep.up:
            ep.up, ep.down_since, ep.pause = False, now, FIRST_PAUSE_S
            ep.outages += 1
            log.warning("endpoint %s out of rotation (%s); trying it again from time to time, the others go on",
                        ep.url, reason)
        elif probe:
            ep.pause = min(ep.pause * 2, LONGEST_PAUSE_S)
        else:
            return
        ep.retry_at = now + ep.pause

    def _back_up(self, ep: Endpoint) -> None:
        ep.failures_in_row = 0
        if not ep.up:
            log.info("endpoint %s answers again (out of rotation for %.0f s)", ep.url,
                     time.monotonic() - (ep.down_since or time.monotonic()))
            ep.up, ep.down_since = True, None

    # -- one request ------------------------------------------------------------------------------------------

    async def _ask(self, http: httpx.AsyncClient, ep: Endpoint, prompt: Prompt, dialect: str | None = None
                   ) -> Answer:
        dialect = dialect or ep.dialect
        if ep.model is None:
            await self._introduce(http, ep)
        try:
            response = await http.post(f"{ep.url}/completions", json=self._body(ep, prompt, dialect))
        except httpx.TimeoutException as err:
            if isinstance(err, httpx.ConnectTimeout):
                raise _Unreachable(f"connect timeout: {err}") from None
            raise _Failed(f"no answer within {self.gen.timeout_s:.0f} s (data.generation.timeout_s)") from None
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
            raise _Unreachable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
        status = response.status_code
        if status == 404:
            raise RegenerationError(f"{ep.url}/completions not found (HTTP 404): the server does not serve the "
                                    "completions API the project renders prompts for")
        if status in (400, 422) and dialect == "ids":
            # A strict OpenAI server? The same request as text; refused again, the request itself is at fault.
            answer = await self._ask(http, ep, prompt, dialect="text")
            if ep.dialect == "ids":
                ep.dialect = "text"
                log.warning("endpoint %s takes no token ids (HTTP %d: %s): prompts go as text and answers are "
                            "tokenized with the target's tokenizer", ep.url, status, _detail(response))
            return answer
        if status in (429, 502, 503, 504):
            raise _Unreachable(f"HTTP {status}: {_detail(response)}")
        if 400 <= status < 500:
            raise _Rejected(f"HTTP {status}: {_detail(response)}")
        if status >= 500:
            raise _Failed(f"HTTP {status}: {_detail(response)}")
        try:
            choice = response.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Failed(f"not a completions answer: {response.text[:200]!r}") from None
        return self._answer(ep, prompt, choice)

    def _body(self, ep: Endpoint, prompt: Prompt, dialect: str) -> dict[str, Any]:
        gen = self.gen
        body: dict[str, Any] = {"model": ep.model, "max_tokens": prompt.max_tokens, "temperature": gen.temperature}
        if gen.temperature > 0:
            body.update(top_p=gen.top_p, seed=request_seed(gen.seed, prompt.key))
        if dialect == "text":
            body["prompt"] = self.tokenizer.decode(prompt.ids, skip_special_tokens=False)
            return body
        body.update(prompt=prompt.ids, return_token_ids=True, stop_token_ids=sorted(self.stop_ids),
                    skip_special_tokens=False)
        return body

    def _answer(self, ep: Endpoint, prompt: Prompt, choice: dict[str, Any]) -> Answer:
        finish = choice.get("finish_reason") or "stop"
        ids = choice.get("token_ids")
        from_text = ids is None
        if from_text:
            tokens = self.tokenizer.encode(choice.get("text") or "", add_special_tokens=False)
        else:
            tokens = [int(t) for t in ids]
        tokens = tokens[: prompt.max_tokens]
        body = tokens[:-1] if tokens and tokens[-1] in self.stop_ids else tokens
        differs = False
        if not from_text and body:
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            differs = self.tokenizer.encode(text, add_special_tokens=False) != body
        if finish != "length" and (not tokens or tokens[-1] not in self.stop_ids) and len(tokens) < prompt.max_tokens:
            # The server ended the answer but left its stop token out (text answers, some engines' ids).
            matched = choice.get("stop_reason", choice.get("matched_stop"))
            tokens.append(matched if isinstance(matched, int) and matched in self.stop_ids else self.default_stop)
        return Answer(prompt.key, tokens, "length" if finish == "length" else "stop", ep.url, from_text=from_text,
                      retokenize_differs=differs)


def request_seed(seed: int, key: int) -> int:
    """One sample's sampling seed: the same for every request of it, whatever endpoint answers."""
    return (seed * 1_000_003 + key) % 2**31


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or body.get("message") or body
        if isinstance(detail, dict):
            detail = detail.get("message", detail)
        return str(detail)[:200]
    return str(body)[:200]
