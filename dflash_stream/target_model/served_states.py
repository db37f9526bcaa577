"""The target's hidden states from vLLM servers (extract.engine vllm): the client an extractor runs for its shard.

Each sample goes to a server as one `/v1/completions` request: its token ids as the prompt, `max_tokens` 1, and
`kv_transfer_params` naming a file in the spool. The server (started with `dflash-stream serve-command`'s flags)
computes the prompt's states of the captured layers and its connector writes them there
(`hidden_states` [tokens, layers, hidden] and `token_ids`), under the file's name only once complete. The client
then reads the file, checks that the token ids are the ones it sent and the shape and dtype are this run's, and
hands the states over as the server computed them; the caller deletes the file (`Served.release`) once they are
packed. File names start with the writer's name (one per run and extractor) and an id of this process.

The spool is bounded: every request reserves its file's bytes (its tokens x layers x hidden x the server's
element size, 4 until the first file tells) out of this extractor's share of extract.spool_bytes, and gives
them back when its file is deleted, so the files never exceed the share. A request whose states do not come (an
error status, no answer in extract.timeout_s, a file that does not appear in time or does not read back right) is
sent again under a new file name, up to extract.retries times, then reported as `Failed` with its sample id. A
server that cannot be reached leaves the rotation and is tried again after a growing pause; its requests wait for
another server (they keep their tries) until every server has been unreachable for extract.give_up_s. A file
written for a request given up on is deleted when it appears; files of an earlier run of the same extractor are
deleted at start and whenever they appear.

Runs an asyncio loop in a background thread; `submit` and `next` are called from the extractor's thread.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from dflash_stream.config import ConfigError, ExtractConfig
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger
from dflash_stream.target_model.vllm_serve import SPOOL_FILE_KEY

log = get_logger(__name__)

ELEMENT_BYTES_UNTIL_KNOWN = 4
"""float32, the widest dtype a server computes in, until the first file says which it uses."""
FILE_OVERHEAD_BYTES = 4096
"""A spool file's safetensors header (and token ids rounding), beyond its tensors' bytes."""
MAX_IN_FLIGHT = 256
"""Requests one extractor keeps in flight at most, whatever room the spool has."""
FIRST_PAUSE_S, LONGEST_PAUSE_S = 2.0, 60.0
"""Pause before an unreachable server is tried again, doubled at each failed try up to the longest."""
CONNECT_TIMEOUT_S = 10.0
POLL_S = 0.02
"""How often a file that is not there yet is looked for."""
SWEEP_EVERY_S = 2.0
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ServedStatesError(DFlashError):
    """The servers cannot deliver this run's states (wrong flags, wrong spool, none reachable)."""


class _Unreachable(Exception):
    """No connection, or it broke: the server, not the request, is at fault."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused
        """Nothing listens at the server's address (it is not running)."""


class _Retry(Exception):
    """This request's states did not come; sending it again may help."""

    def __init__(self, message: str, may_come: bool = False) -> None:
        super().__init__(message)
        self.may_come = may_come
        """Its file may still be written later (the server may still be working on it)."""


@dataclass
class _Job:
    key: int
    ids: list[int]
    payload: Any
    reserved: int
    attempts: int = 0


@dataclass
class Served:
    """A sample's states, checked: [tokens, layers x hidden] in the server's dtype, layers side by side in id
    order."""

    key: int
    payload: Any
    states: torch.Tensor
    endpoint: str
    _client: StateClient
    _path: Path
    _reserved: int

    def release(self) -> None:
        """Delete the spool file and give its room back (once the states are packed)."""
        self._client._remove(self._path)
        self._client._free(self._reserved)


@dataclass
class Failed:
    """No states after every try."""

    key: int
    payload: Any
    error: str
    endpoint: str
    tries: int


@dataclass
class _Endpoint:
    url: str
    model: str | None = None
    up: bool = True
    probing: bool = False
    retry_at: float = 0.0
    pause: float = FIRST_PAUSE_S
    down_since: float | None = None
    in_flight: int = 0
    states: int = 0
    outages: int = 0


class StateClient:
    """Asks `ext.endpoints` for the states of samples, keeping their files within `share_bytes` of the spool."""

    def __init__(self, ext: ExtractConfig, spool: Path, layer_ids: list[int], hidden_size: int, writer: str,
                 share_bytes: int, max_tokens: int) -> None:
        self.ext, self.spool = ext, Path(spool)
        self.layers, self.hidden_size = len(layer_ids), hidden_size
        self.layer_ids = list(layer_ids)
        self.owner = f"{writer}-"
        # One run of this extractor: a restarted one never takes an earlier run's late file for its own.
        self.prefix = f"{self.owner}{uuid.uuid4().hex[:8]}-"
        self.budget = share_bytes
        self.element_bytes = ELEMENT_BYTES_UNTIL_KNOWN
        largest = self.file_bytes(max_tokens)
        if largest > share_bytes:
            raise ConfigError(f"extract.spool_bytes: this extractor's share ({share_bytes:,} bytes) is less than the "
                              f"file of one sample of data.max_length tokens ({largest:,} bytes at up to "
                              f"{ELEMENT_BYTES_UNTIL_KNOWN} bytes per value); raise it to at least {largest:,} "
                              "times the number of extractors")
        self.endpoints = [_Endpoint(url) for url in ext.endpoints]
        self.reserved = 0
        self.in_flight = 0
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._results: queue.Queue = queue.Queue()
        self._abandoned: dict[str, tuple[float, int, str]] = {}
        """File name of a request given up on -> (when to stop waiting for it, its reserved bytes, its server)."""
        self._fatal: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sends = itertools.count()
        self._stop: asyncio.Event | None = None

    def file_bytes(self, tokens: int) -> int:
        """What one request's spool file takes: its states at the server's element size, and its token ids."""
        return tokens * (self.layers * self.hidden_size * self.element_bytes + 8) + FILE_OVERHEAD_BYTES

    # -- the extractor's side ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Check the spool, remove this extractor's leftovers there, learn each server's model; raises
        ServedStatesError or ConfigError in one line."""
        try:
            self.spool.mkdir(parents=True, exist_ok=True)
            probe = self.spool / f".{self.prefix}probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"extract.spool: cannot write to {self.spool} ({err.strerror or err}); the extractors "
                              "delete the servers' files there") from None
        left = self._sweep_others()
        if left:
            log.info("removed %d spool file(s) an earlier run of this extractor left in %s", left, self.spool)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, args=(ready,), name="served-states", daemon=True)
        self._thread.start()
        ready.wait()
        self._raise_fatal()

    def room_for(self, tokens: int) -> bool:
        with self._lock:
            return self._room(tokens)

    def wait_for_room(self, tokens: int, timeout: float) -> bool:
        """Wait up to `timeout` seconds for room to ask for a sample of `tokens` (files deleted by the caller)."""
        with self._freed:
            return self._freed.wait_for(lambda: self._room(tokens), timeout)

    def _room(self, tokens: int) -> bool:
        return self.in_flight < MAX_IN_FLIGHT and self.reserved + self.file_bytes(tokens) <= self.budget

    def submit(self, key: int, ids: list[int], payload: Any) -> None:
        """Ask for one sample's states (call `room_for` first: this reserves its file's bytes regardless)."""
        self._raise_fatal()
        reserved = self.file_bytes(len(ids))
        with self._lock:
            self.reserved += reserved
            self.in_flight += 1
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._job(_Job(key, list(ids), payload, reserved)), self._loop)

    def next(self, timeout: float | None = None) -> Served | Failed | None:
        """The next outcome (None after `timeout` seconds without one); raises the client's fatal error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._raise_fatal()
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            try:
                outcome = self._results.get(timeout=wait) if wait > 0 else self._results.get_nowait()
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            with self._freed:
                self.in_flight -= 1
                self._freed.notify_all()
            self._raise_fatal()  # a request that met it is reported by it
            return outcome

    def stats(self) -> dict[str, Any]:
        return {ep.url: {"states": ep.states, "outages": ep.outages, "model": ep.model} for ep in self.endpoints}

    def close(self) -> None:
        """Stop the loop; the files of requests still out are removed when they appear at the next start."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._thread = None

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _free(self, nbytes: int) -> None:
        with self._freed:
            self.reserved -= nbytes
            self._freed.notify_all()

    @staticmethod
    def _remove(path: Path) -> None:
        for leftover in (path, path.with_name(path.name + ".partial")):
            leftover.unlink(missing_ok=True)

    def _sweep_others(self) -> int:
        """Delete the spool files of this extractor's earlier runs (its own prefix, another run's id)."""
        count = 0
        for path in self.spool.glob(f"{self.owner}*"):
            if not path.name.startswith(self.prefix):
                path.unlink(missing_ok=True)
                count += 1
        return count

    # -- the loop ---------------------------------------------------------------------------------------------

    def _run_loop(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main(ready))
        except BaseException as err:  # handed to the extractor's thread
            self._fatal = err
            ready.set()
        finally:
            self._loop.close()

    async def _main(self, ready: threading.Event) -> None:
        self._stop = asyncio.Event()
        timeout = httpx.Timeout(self.ext.timeout_s, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=MAX_IN_FLIGHT + len(self.endpoints), max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            self._http = http
            for ep in self.endpoints:
                try:
                    await self._introduce(ep)
                except _Unreachable as err:
                    self._mark_down(ep, str(err))
            ready.set()
            self._watchdog_task = asyncio.create_task(self._watchdog())
            try:
                await self._stop.wait()
            finally:  # the watchdog and any request still out
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in others:
                    task.cancel()
                await asyncio.gather(*others, return_exceptions=True)

    async def _introduce(self, ep: _Endpoint) -> None:
        try:
            response = await self._http.get(f"{ep.url}/models", timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError as err:
            raise _Unreachable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
        served = [m.get("id") for m in response.json().get("data", [])] if response.status_code == 200 else []
        if not served:
            raise ServedStatesError(f"extract.endpoints: {ep.url}/models lists no model (HTTP {response.status_code});"
                                    " give the base URL of a vLLM server, such as http://host:8000/v1")
        ep.model = served[0]

    async def _watchdog(self) -> None:
        """Stop everything when no server was reachable for give_up_s; delete the files nobody waits for."""
        last_sweep = 0.0
        while True:
            await asyncio.sleep(0.5)
            downs = [ep.down_since for ep in self.endpoints if not ep.up]
            if len(downs) == len(self.endpoints) and time.monotonic() - max(downs) > self.ext.give_up_s:
                self._fatal = ServedStatesError(
                    f"no extraction server answered for {self.ext.give_up_s:.0f} s (extract.give_up_s): "
                    f"{', '.join(ep.url for ep in self.endpoints)}; start them and run again: what is stored is kept")
                self._stop.set()
                return
            for name, (until, _, _) in list(self._abandoned.items()):
                if (self.spool / name).exists() or time.monotonic() > until:
                    self._forget(name)
            if time.monotonic() - last_sweep > SWEEP_EVERY_S:
                last_sweep = time.monotonic()
                self._sweep_others()

    async def _turn(self) -> tuple[_Endpoint, bool]:
        """The up endpoint with the fewest requests out; while all are down, one request at a time probes the one
        whose pause is over (returns it with True)."""
        while True:
            up = [ep for ep in self.endpoints if ep.up]
            if up:
                return min(up, key=lambda ep: ep.in_flight), False
            now = time.monotonic()
            for ep in self.endpoints:
                if not ep.probing and now >= ep.retry_at:
                    ep.probing = True
                    return ep, True
            await asyncio.sleep(0.1)

    def _mark_down(self, ep: _Endpoint, reason: str, probe: bool = False) -> None:
        now = time.monotonic()
        if ep.up:
            ep.up, ep.down_since, ep.pause = False, now, FIRST_PAUSE_S
            ep.outages += 1
            log.warning("extraction server %s out of rotation (%s); trying it again from time to time", ep.url, reason)
        elif probe:
            ep.pause = min(ep.pause * 2, LONGEST_PAUSE_S)
        else:
            return
        ep.retry_at = now + ep.pause

    def _back_up(self, ep: _Endpoint) -> None:
        if not ep.up:
            log.info("extraction server %s answers again (out of rotation for %.0f s)", ep.url,
                     time.monotonic() - (ep.down_since or time.monotonic()))
            ep.up, ep.down_since = True, None

    async def _job(self, job: _Job) -> None:
        try:
            self._results.put(await self._attempts(job))
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # a fatal error: the extractor's thread raises it
            self._fatal = self._fatal or err
            self._results.put(Failed(job.key, job.payload, str(err), "", job.attempts))

    async def _attempts(self, job: _Job) -> Served | Failed:
        last, where = "", ""
        while True:
            await self._reserve(job)
            ep, probe = await self._turn()
            name = f"{self.prefix}{job.key}-{next(self._sends)}.safetensors"
            ep.in_flight += 1
            try:
                served = await self._send(ep, job, name)
            except _Unreachable as err:
                if err.refused:  # nothing listens there: requests it had are gone, no file of theirs will come
                    for old in [n for n, (_, _, url) in self._abandoned.items() if url == ep.url]:
                        self._forget(old)
                    self._remove(self.spool / name)
                else:
                    self._abandon(name, job, ep)
                self._mark_down(ep, str(err), probe)
                continue  # the server's fault: the request keeps its tries
            except _Retry as err:
                if err.may_come:
                    self._abandon(name, job, ep)
                self._back_up(ep)
                job.attempts += 1
                last, where = str(err), ep.url
                if job.attempts > self.ext.retries:
                    self._free(job.reserved)
                    return Failed(job.key, job.payload, last, where, job.attempts)
                log.warning("sample %d: no states from %s (%s); asking again (%d of %d tries)", job.key, ep.url, err,
                            job.attempts + 1, self.ext.retries + 1)
                continue
            finally:
                ep.in_flight -= 1
                if probe:
                    ep.probing = False
            self._back_up(ep)
            ep.states += 1
            return served

    async def _reserve(self, job: _Job) -> None:
        """Room for the job's file (again, when it is sent again: its earlier file may still come)."""
        if job.reserved:
            return
        need = self.file_bytes(len(job.ids))
        while True:
            with self._lock:
                if self.reserved + need <= self.budget:
                    self.reserved += need
                    job.reserved = need
                    return
            await asyncio.sleep(0.05)

    def _abandon(self, name: str, job: _Job, ep: _Endpoint) -> None:
        """A request given up on whose file may still come: its room stays reserved until the file appears (and
        is deleted) or timeout_s passes (a server that died writes nothing); the job reserves anew."""
        self._abandoned[name] = (time.monotonic() + self.ext.timeout_s, job.reserved, ep.url)
        job.reserved = 0

    def _forget(self, name: str) -> None:
        _, reserved, _ = self._abandoned.pop(name)
        self._remove(self.spool / name)
        self._free(reserved)

    async def _send(self, ep: _Endpoint, job: _Job, name: str) -> Served:
        if ep.model is None:
            await self._introduce(ep)
        body = {"model": ep.model, "prompt": job.ids, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {SPOOL_FILE_KEY: name}}
        try:
            response = await self._http.post(f"{ep.url}/completions", json=body)
        except httpx.TimeoutException as err:
            if isinstance(err, httpx.ConnectTimeout):
                raise _Unreachable(f"connect timeout: {err}") from None
            raise _Retry(f"no answer within {self.ext.timeout_s:.0f} s (extract.timeout_s)", may_come=True) from None
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
            raise _Unreachable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__,
                               refused=isinstance(err, httpx.ConnectError)) from None
        status = response.status_code
        if status == 404:
            raise ServedStatesError(f"extract.endpoints: {ep.url}/completions not found (HTTP 404): not a vLLM server")
        if status in (429, 502, 503, 504):
            raise _Unreachable(f"HTTP {status}: {response.text[:200]}")
        if status != 200:
            self._remove(self.spool / name)
            raise _Retry(f"HTTP {status}: {response.text[:300]}")
        try:
            reported = (response.json().get("kv_transfer_params") or {}).get("hidden_states_path")
        except ValueError:
            raise _Retry(f"not a completions answer: {response.text[:200]!r}") from None
        path = self.spool / name
        if reported is None:
            raise ServedStatesError(
                f"{ep.url} returned no hidden_states_path: it was not started with this run's extraction flags "
                "(`dflash-stream serve-command --config ...` prints them)")
        if Path(reported) != path:
            raise ServedStatesError(
                f"{ep.url} writes the states to {Path(reported).parent}, the extractors read extract.spool "
                f"{self.spool}: start the server with this config's `dflash-stream serve-command` (a shared "
                "folder must have the same path on both sides)")
        states = await self._read(path, job, ep)
        return Served(job.key, job.payload, states, ep.url, self, path, job.reserved)

    async def _read(self, path: Path, job: _Job, ep: _Endpoint) -> torch.Tensor:
        """The file's states once it is there (a missing or late one: _Retry), checked against the request."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        deadline = time.monotonic() + self.ext.timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise _Retry(f"its file {path.name} did not appear within {self.ext.timeout_s:.0f} s "
                             "(extract.timeout_s)", may_come=True)
            await asyncio.sleep(POLL_S)
        try:
            tensors = await asyncio.to_thread(load_file, str(path))
            hidden, ids = tensors["hidden_states"], tensors["token_ids"]
        except (SafetensorError, OSError, KeyError) as err:
            self._remove(path)
            raise _Retry(f"its file {path.name} is damaged: {err}") from None
        wanted = (len(job.ids), self.layers, self.hidden_size)
        if tuple(hidden.shape[1:]) != wanted[1:] or hidden.dtype not in FLOAT_DTYPES:
            self._remove(path)
            raise ServedStatesError(
                f"{ep.url} wrote states of shape {list(hidden.shape)} and dtype {hidden.dtype}; this run stores "
                f"[tokens, {self.layers}, {self.hidden_size}] (layers {self.layer_ids} of its target): start the "
                "server with this config's `dflash-stream serve-command`")
        if hidden.shape[0] != len(job.ids) or ids.tolist() != job.ids:
            self._remove(path)
            raise _Retry(f"its file {path.name} holds {hidden.shape[0]} tokens' states for other token ids than "
                         f"the {len(job.ids)} sent")
        if self.element_bytes != hidden.element_size():
            self.element_bytes = hidden.element_size()  # the server's dtype: files of later requests are sized by it
        return hidden.reshape(len(job.ids), self.layers * self.hidden_size)


def share_bytes(ext: ExtractConfig, extractors: int) -> int:
    """One extractor's part of extract.spool_bytes."""
    return int(ext.spool_bytes) // max(1, extractors)

