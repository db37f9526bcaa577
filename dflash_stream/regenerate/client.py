"""The target's answers from OpenAI-compatible servers: many endpoints, many requests in flight, exact token ids.

Every endpoint gets `concurrency` workers that take prompts from one shared queue, so a faster server takes more
of the work and an unreachable one none: it leaves the rotation with one log line, one of its workers tries it
again after a growing pause, and it rejoins with another line. A request whose answer fails (an error status, no
answer within `timeout_s`, a malformed or aborted answer) is sent again up to `retries` times, to whichever
endpoint is free, then reported with its sample id and the last error; the others go on.

What counts as a failed try of a request and what as an outage of its endpoint: a dropped connection or a
429/502/503/504 counts against the request only while the same endpoint answers others (another answer came
since the request was sent, or its /models answers now). An endpoint-wide outage (a server restarting) costs no
request a try: the endpoint leaves the rotation and `give_up_s` bounds the wait.

Before its first request each endpoint is checked once: the model it serves (data.generation.model, else the one
named like target.model, else its only one), the longest sequence it takes against data.max_length (vLLM lists
`max_model_len`), and its tokenizer (vLLM's /tokenize of a probe text, else the prompt token count a completion
of it reports) against the target's. A server with another tokenizer, or one whose answers come malformed
MALFORMED_TO_DROP times in a row (ids outside the tokenizer, no choices), leaves the phase; a refused API key
(HTTP 401/403) stops it at once.

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
MALFORMED_TO_DROP = 3
"""Malformed answers in a row after which an endpoint leaves the phase for good."""
CONNECT_TIMEOUT_S = 10.0
FINISHED = ("stop", "length")
"""Finish reasons of an answer; any other (abort, content_filter, none) is a failed try, never cached."""
PROBE_TEXT = "Tokenizer check: naïve café, 12,345 × 6.78 = 83,699.1; def f(x): return x ** 2  # ✓ 東京 😀"
"""Text each endpoint tokenizes once: mixed scripts, digits and code, so that another vocabulary tells."""


class RegenerationError(DFlashError):
    """The servers cannot finish the phase: every endpoint unreachable for too long or dropped, an endpoint that
    does not serve completions, or an API key refused."""


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


class _Malformed(_Failed):
    """The server's answer is not one: no choice, ids outside the tokenizer, no text."""


@dataclass
class _Job:
    prompt: Prompt
    attempts: int = 0


@dataclass
class Endpoint:
    url: str
    model: str | None = None
    checked: bool = False
    """Its model, maximum length and tokenizer were checked (at the first contact that got through)."""
    dialect: str = "ids"
    """ids (prompt and answer as token ids) or text (a strict OpenAI server)."""
    up: bool = True
    probing: bool = False
    retry_at: float = 0.0
    pause: float = FIRST_PAUSE_S
    down_since: float | None = None
    dropped: str | None = None
    """Why the endpoint left the phase for good (another tokenizer, malformed answers); None while it serves."""
    failures_in_row: int = 0
    malformed_in_row: int = 0
    last_answer: float = 0.0
    """When it last answered a request (monotonic seconds)."""
    alive_at: float = 0.0
    """When its /models last answered, asked because a request failed."""
    answers: int = 0
    tokens: int = 0
    errors: int = 0
    malformed: int = 0
    outages: int = 0

    def stats(self) -> dict[str, Any]:
        return {"answers": self.answers, "tokens": self.tokens, "errors": self.errors, "malformed": self.malformed,
                "outages": self.outages, "dialect": self.dialect, "model": self.model, "dropped": self.dropped}


class CompletionClient:
    """Sends prompts to the endpoints of `data.generation` and hands each answer to a callback as it comes."""

    def __init__(self, gen: GenerationConfig, tokenizer, stop_ids: set[int], concurrency: int | None = None,
                 target: str | None = None, max_length: int | None = None) -> None:
        """`target`: target.model, to pick the served model by when data.generation.model is unset; `max_length`:
        data.max_length, which every endpoint's maximum model length must reach."""
        if not stop_ids:
            raise ConfigError("target.model: the target names no end-of-sequence token; regeneration cannot tell "
                              "an ended answer from a cut one")
        self.gen, self.tokenizer, self.stop_ids = gen, tokenizer, stop_ids
        self.target, self.max_length = target, max_length
        self.vocab = len(tokenizer)
        self.concurrency = concurrency or gen.concurrency
        self.default_stop = tokenizer.eos_token_id if tokenizer.eos_token_id in stop_ids else min(stop_ids)
        self.endpoints = [Endpoint(url) for url in gen.endpoints]
        self._checking: dict[str, asyncio.Lock] = {}
        self.headers = {"Content-Type": "application/json"}
        if gen.api_key_env:
            key = os.environ.get(gen.api_key_env)
            if not key:
                raise ConfigError(f"data.generation.api_key_env: the environment variable {gen.api_key_env} is not "
                                  "set (it should hold the servers' API key)")
            self.headers["Authorization"] = f"Bearer {key}"

    def run(self, prompts: Iterable[Prompt], on_answer: Callable[[Answer], None]) -> None:
        """Ask for every prompt (in order, `concurrency` at a time per endpoint); returns when each has an answer
        or an error. Raises RegenerationError when no endpoint can be reached for `give_up_s`, every endpoint
        left the phase, or an API key is refused."""
        asyncio.run(self._run(list(prompts), on_answer))

    # -- the event loop ---------------------------------------------------------------------------------------

    async def _run(self, prompts: list[Prompt], on_answer: Callable[[Answer], None]) -> None:
        if not prompts:
            return
        queue: asyncio.Queue[_Job] = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(_Job(prompt))
        self._checking = {ep.url: asyncio.Lock() for ep in self.endpoints}
        timeout = httpx.Timeout(self.gen.timeout_s, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=self.concurrency * len(self.endpoints) + len(self.endpoints),
                              max_keepalive_connections=self.concurrency * len(self.endpoints))
        fatal: list[BaseException] = []
        stop = asyncio.Event()  # set with the first fatal error: every worker ends
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=self.headers) as http:
            await asyncio.gather(*(self._first_contact(http, ep) for ep in self.endpoints))
            self._check_some_left()
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
        """Check each endpoint before the work starts; one that cannot be reached starts out of rotation (its
        first request checks it)."""
        try:
            await self._introduce(http, ep)
        except _Unreachable as err:
            self._mark_down(ep, str(err))

    async def _introduce(self, http: httpx.AsyncClient, ep: Endpoint) -> None:
        """The served model (checked against data.generation.model when that is set), its maximum length, and
        its tokenizer; an endpoint serving another tokenizer leaves the phase."""
        try:
            response = await http.get(f"{ep.url}/models", timeout=min(CONNECT_TIMEOUT_S, self.gen.timeout_s))
        except httpx.HTTPError as err:
            raise _Unreachable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
        status = response.status_code
        if status == 404:
            raise ConfigError(f"data.generation.endpoints: {ep.url}/models not found (HTTP 404); give the base URL "
                              "the server's OpenAI API lives under, such as http://host:8000/v1")
        self._refuse_auth(ep, response)
        if status in (429, 502, 503, 504):
            raise _Unreachable(f"HTTP {status} at /models: {_detail(response)}")
        listed: dict[str, dict[str, Any]] = {}
        if status == 200:
            try:
                listed = {m["id"]: m for m in response.json().get("data", []) if isinstance(m, dict) and m.get("id")}
            except (ValueError, AttributeError):
                listed = {}
        ep.model = self._served_model(ep, listed, status)
        longest = listed.get(ep.model, {}).get("max_model_len")
        if isinstance(longest, int) and self.max_length and longest < self.max_length:
            raise ConfigError(
                f"data.max_length: {ep.url} serves {ep.model} with a maximum model length of {longest:,} tokens, below "
                f"data.max_length {self.max_length:,}: every longer sample would be refused one by one; restart the "
                f"server with --max-model-len {self.max_length} (or more), or lower data.max_length to {longest}")
        mismatch = await self._tokenizer_mismatch(http, ep)
        if mismatch:
            self._drop(ep, f"it serves {ep.model}, whose tokenizer is not the target's ({mismatch}); point "
                           "data.generation.endpoints at servers of target.model, or name the model in "
                           "data.generation.model")
        ep.checked = True

    def _served_model(self, ep: Endpoint, listed: dict[str, dict[str, Any]], status: int) -> str:
        """data.generation.model, else the listed model named as target.model (or as its last path part), else
        the only one listed; several others are refused naming them."""
        served = list(listed)
        if self.gen.model is not None:
            if served and self.gen.model not in served:
                raise ConfigError(f"data.generation.model: '{self.gen.model}' is not served at {ep.url}; it serves "
                                  f"{', '.join(served)}")
            return self.gen.model
        if not served:
            raise ConfigError(f"data.generation.model: {ep.url}/models lists no model (HTTP {status}); name the "
                              "served model")
        if self.target:
            tail = self.target.rstrip("/").rsplit("/", 1)[-1]
            named = [m for m in served if m == self.target] or [m for m in served if m.rsplit("/", 1)[-1] == tail]
            if named:
                return named[0]
        if len(served) == 1:
            return served[0]
        raise ConfigError(f"data.generation.model: {ep.url} serves {', '.join(served)}, none named as target.model "
                          f"{self.target}; name the one to ask")

    async def _tokenizer_mismatch(self, http: httpx.AsyncClient, ep: Endpoint) -> str | None:
        """How the endpoint's tokenizer differs from the target's on PROBE_TEXT (None: the same, or the server
        cannot tell): vLLM's /tokenize gives its ids; other servers' prompt token count of a one-token
        completion of it must be the target's, with or without its special tokens."""
        expected = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        root = ep.url.removesuffix("/v1")
        try:
            response = await http.post(f"{root}/tokenize", json={"model": ep.model, "prompt": PROBE_TEXT,
                                                                  "add_special_tokens": False},
                                       timeout=min(CONNECT_TIMEOUT_S, self.gen.timeout_s))
            self._refuse_auth(ep, response)
            tokens = response.json().get("tokens") if response.status_code == 200 else None
            if isinstance(tokens, list):
                if tokens == expected:
                    return None
                first = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
                             min(len(tokens), len(expected)))
                return (f"its /tokenize of a probe text gives {len(tokens)} ids, the target's tokenizer "
                        f"{len(expected)}, differing from position {first}")
            response = await http.post(f"{ep.url}/completions", json={"model": ep.model, "prompt": PROBE_TEXT,
                                                                      "max_tokens": 1, "temperature": 0.0})
            self._refuse_auth(ep, response)
            counted = response.json().get("usage", {}).get("prompt_tokens") if response.status_code == 200 else None
        except httpx.HTTPError as err:
            raise _Unreachable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
        except (ValueError, AttributeError):
            counted = None
        if not isinstance(counted, int):
            log.info("endpoint %s: its tokenizer cannot be checked (no /tokenize, no prompt token count)", ep.url)
            return None
        with_special = len(self.tokenizer.encode(PROBE_TEXT))
        if counted in (len(expected), with_special):
            return None
        return f"it counts {counted} tokens in a probe text, the target's tokenizer {len(expected)}"

    def _refuse_auth(self, ep: Endpoint, response: httpx.Response) -> None:
        """401/403: every request would be refused alike; the phase stops at once naming the key's variable."""
        if response.status_code not in (401, 403):
            return
        env = self.gen.api_key_env
        fix = (f"check the API key in ${env} (data.generation.api_key_env)" if env else
               "the server wants an API key: set data.generation.api_key_env to the variable that holds it")
        raise RegenerationError(f"{ep.url} refused the request: HTTP {response.status_code} ({_detail(response)}); "
                                f"{fix}")

    def _drop(self, ep: Endpoint, reason: str) -> None:
        """The endpoint leaves the phase for good (its workers end); the others go on."""
        if ep.dropped is None:
            ep.dropped, ep.up = reason, False
            log.warning("endpoint %s left the phase: %s", ep.url, reason)

    def _check_some_left(self) -> None:
        if all(ep.dropped for ep in self.endpoints):
            raise RegenerationError("no endpoint is left to ask: " + "; ".join(
                f"{ep.url}: {ep.dropped}" for ep in self.endpoints))

    async def _watchdog(self, fatal: list[BaseException], stop: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self._check_some_left()
            except RegenerationError as err:
                fatal.append(err)
                stop.set()
                return
            serving = [ep for ep in self.endpoints if not ep.dropped]
            downs = [ep.down_since for ep in serving if not ep.up and ep.down_since is not None]
            if len(downs) == len(serving) and time.monotonic() - max(downs) > self.gen.give_up_s:
                fatal.append(RegenerationError(
                    f"no endpoint answered for {self.gen.give_up_s:.0f} s (data.generation.give_up_s): "
                    f"{', '.join(ep.url for ep in serving)}; start the servers and run again: what is "
                    "answered is kept"))
                stop.set()
                return

    async def _worker(self, http: httpx.AsyncClient, ep: Endpoint, queue: asyncio.Queue[_Job],
                      on_answer: Callable[[Answer], None], fatal: list[BaseException], stop: asyncio.Event) -> None:
        try:
            while ep.dropped is None:
                await self._one_job(http, ep, queue, on_answer)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a server that cannot do the work, or the cache cannot be written: all stop
            fatal.append(err)
            stop.set()

    async def _one_job(self, http: httpx.AsyncClient, ep: Endpoint, queue: asyncio.Queue[_Job],
                       on_answer: Callable[[Answer], None]) -> None:
        probe = await self._turn(ep)
        if probe is None:  # the endpoint left the phase
            return
        job = await queue.get()
        sent = time.monotonic()
        try:
            if ep.dropped is not None:  # left while this worker waited for a job: the job goes back
                queue.put_nowait(job)
                return
            answer = await self._ask(http, ep, job.prompt)
        except _Unreachable as err:
            if ep.dropped is not None:  # it left the phase (its check failed): the job goes to the others
                queue.put_nowait(job)
            elif await self._answers_others(http, ep, sent, err):
                self._failed_try(ep, job, err, queue, on_answer, probe)  # the endpoint is up: this request failed
            else:
                self._mark_down(ep, str(err), probe)
                queue.put_nowait(job)  # not the request's fault: it keeps its tries
        except _Failed as err:
            if isinstance(err, _Malformed):
                ep.malformed += 1
                ep.malformed_in_row += 1
                if ep.malformed_in_row >= MALFORMED_TO_DROP:
                    self._drop(ep, f"{ep.malformed_in_row} malformed answers in a row, the last: {err}")
            self._failed_try(ep, job, err, queue, on_answer, probe)
        except _Rejected as err:
            ep.errors += 1
            self._back_up(ep)
            log.warning("sample %d: %s refused the request: %s", job.prompt.key, ep.url, err)
            on_answer(Answer(job.prompt.key, None, "error", ep.url, error=str(err)))
        else:
            self._back_up(ep)
            ep.malformed_in_row = 0
            ep.last_answer = time.monotonic()
            ep.answers += 1
            ep.tokens += len(answer.tokens or [])
            on_answer(answer)
        finally:
            if probe:
                ep.probing = False
            queue.task_done()

    def _failed_try(self, ep: Endpoint, job: _Job, err: Exception, queue: asyncio.Queue[_Job],
                    on_answer: Callable[[Answer], None], probe: bool) -> None:
        """A try that counts against the request: sent again while it has tries left, else reported."""
        job.attempts += 1
        ep.failures_in_row += 1
        if ep.dropped is None and (ep.failures_in_row >= FAILURES_TO_PAUSE or probe):
            self._mark_down(ep, f"{ep.failures_in_row} failed answers in a row, the last: {err}", probe)
        if job.attempts > self.gen.retries:
            ep.errors += 1
            log.warning("sample %d: no answer after %d tries (data.generation.retries %d), the last from %s: %s",
                        job.prompt.key, job.attempts, self.gen.retries, ep.url, err)
            on_answer(Answer(job.prompt.key, None, "error", ep.url, error=str(err)))
        else:
            queue.put_nowait(job)

    async def _answers_others(self, http: httpx.AsyncClient, ep: Endpoint, sent: float, err: _Unreachable) -> bool:
        """Whether `ep` still serves although this request, sent at `sent`, failed: it answered another request
        since, or (unless it asked us to slow down: a 429 is the whole endpoint's) its /models answers now. One
        look per endpoint at a time: the requests failing together with this one share it."""
        if ep.last_answer > sent:
            return True
        if str(err).startswith("HTTP 429"):
            return False
        async with self._checking[ep.url]:
            if ep.last_answer > sent or ep.alive_at > sent:
                return True
            if not ep.up and ep.down_since is not None and ep.down_since > sent:
                return False  # another request just found it down
            try:
                response = await http.get(f"{ep.url}/models", timeout=min(CONNECT_TIMEOUT_S, self.gen.timeout_s))
                alive = response.status_code == 200
            except httpx.HTTPError:
                alive = False
            if alive:
                ep.alive_at = time.monotonic()
            return alive

    async def _turn(self, ep: Endpoint) -> bool | None:
        """Wait until this worker may send to `ep`: at once while it is up; while it is down, one worker tries it
        again once its pause is over (returns True: that worker probes); None once it left the phase."""
        while True:
            if ep.dropped is not None:
                return None
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
        if not ep.up and ep.dropped is None:
            log.info("endpoint %s answers again (out of rotation for %.0f s)", ep.url,
                     time.monotonic() - (ep.down_since or time.monotonic()))
            ep.up, ep.down_since = True, None

    # -- one request ------------------------------------------------------------------------------------------

    async def _ask(self, http: httpx.AsyncClient, ep: Endpoint, prompt: Prompt, dialect: str | None = None
                   ) -> Answer:
        dialect = dialect or ep.dialect
        if not ep.checked:
            async with self._checking[ep.url]:  # one check, not one per waiting worker
                if not ep.checked:
                    await self._introduce(http, ep)
            if ep.dropped is not None:
                raise _Unreachable(f"left the phase: {ep.dropped}")
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
        self._refuse_auth(ep, response)
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
            raise _Malformed(f"not a completions answer: {response.text[:200]!r}") from None
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

    def _answer(self, ep: Endpoint, prompt: Prompt, choice: Any) -> Answer:
        if not isinstance(choice, dict):
            raise _Malformed(f"a choice that is not an object: {str(choice)[:200]!r}")
        finish = choice.get("finish_reason")
        if finish not in FINISHED:  # aborted, filtered, or no reason given: not an answer
            raise _Failed(f"finish_reason {finish!r} (not stop or length): not an answer")
        ids = choice.get("token_ids")
        from_text = ids is None
        if from_text:
            text = choice.get("text")
            if not isinstance(text, str):
                raise _Malformed(f"an answer without token ids or text: {str(choice)[:200]!r}")
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise _Malformed(f"token_ids that are not a list of integers: {str(ids)[:200]!r}")
            bad = next((t for t in ids if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise _Malformed(f"token id {bad} outside the target's tokenizer (0..{self.vocab - 1})")
            tokens = list(ids)
        tokens = tokens[: prompt.max_tokens]
        body = tokens[:-1] if tokens and tokens[-1] in self.stop_ids else tokens
        differs = False
        if not from_text and body:
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            differs = self.tokenizer.encode(text, add_special_tokens=False) != body
        if finish == "stop" and (not tokens or tokens[-1] not in self.stop_ids) and len(tokens) < prompt.max_tokens:
            # The server ended the answer but left its stop token out (text answers, some engines' ids).
            matched = choice.get("stop_reason", choice.get("matched_stop"))
            tokens.append(matched if isinstance(matched, int) and matched in self.stop_ids else self.default_stop)
        return Answer(prompt.key, tokens, finish, ep.url, from_text=from_text, retokenize_differs=differs)


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
