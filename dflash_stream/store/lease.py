"""Leases: which process holds a run's output directory, or a store's writer id or consumer id, judged in a way
that holds across hosts on a shared filesystem.

A lease is a small JSON file naming its holder (host, boot id, pid, the process's start time, since when). It is
created atomically — a private file is written, then `os.link`ed into place, and on NFS as on a local disk
exactly one creator wins — and its holder touches it every HEARTBEAT_SECONDS. A lease is stale, and is taken over
with a log line, when
  - its holder ran on this host (same host name and boot id) and that process is gone (or its pid now names
    another process, or the host rebooted since), or
  - its holder ran on another host and the lease was not touched for STALE_SECONDS. The age is measured on the
    filesystem's own clock (the lease's mtime against that of a file written just now), so clock skew between
    hosts and clock jumps on either host do not count; only a jump of the file server's clock would.
Any other lease is live, and acquiring it refuses with one line naming the holder. No flock and no local pid alone.
A holder that finds its lease taken over (it was judged stale after stalling) stops at once, writing nothing more.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from dflash_stream.log import get_logger
from dflash_stream.store.errors import StoreError

log = get_logger("lease")
HEARTBEAT_SECONDS = 5.0
STALE_SECONDS = 60.0
"""A lease of another host untouched this long is stale (twelve missed heartbeats)."""


class LeaseHeld(StoreError):
    """A live process holds the output directory, writer id or consumer id asked for."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc is missing): tells a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _me() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid, "start": _start_time(pid)}


def _same(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    return all(holder.get(k) == me[k] for k in ("host", "boot", "pid", "start"))



def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _age(path: Path, probe: Path) -> float:
    """Seconds since `path` was last touched, on the filesystem's clock (`probe` was written just now)."""
    return probe.stat().st_mtime - path.stat().st_mtime


def describe(holder: dict[str, Any], age: float | None = None) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
    beat = "" if age is None else f", heartbeat {max(age, 0):.0f} s ago"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {since}{beat}"


def _why_stale(holder: dict[str, Any], age: float) -> str | None:
    """Why the lease's holder can no longer be using it; None while it may."""
    me = _me()
    if holder.get("host") == me["host"]:
        if holder.get("boot") != me["boot"]:
            return "this host has rebooted since"
        pid = int(holder.get("pid", -1))
        if not psutil.pid_exists(pid):
            return f"process {pid} is gone"
        if holder.get("start") and _start_time(pid) != holder["start"]:
            return f"pid {pid} now names another process"
        return None
    if age > STALE_SECONDS:
        return f"no heartbeat for {age:.0f} s from another host (stale after {STALE_SECONDS:.0f} s)"
    return None


class _Leases:
    """The leases this process holds, and the thread that keeps them alive."""

    def __init__(self) -> None:
        self.held: dict[Path, str] = {}
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.pid = os.getpid()
        self.unrefreshed: set[Path] = set()

    def heartbeat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            me = _me()
            with self.lock:  # `release` takes it too: a lease released meanwhile is not mistaken for lost
                for path, what in list(self.held.items()):
                    holder = _read(path)
                    if holder is None:  # its folder was removed: nothing left to hold, nobody else holds it
                        log.warning("%s vanished (%s was removed); no longer held", what, path)
                        del self.held[path]
                        continue
                    if not _same(holder, me):
                        taker = describe(holder)
                        log.error("lost %s to %s (this process was judged stale); stopping at once so that two "
                                  "processes never share it", what, taker)
                        os.kill(os.getpid(), signal.SIGKILL)
                    try:
                        os.utime(path)
                    except OSError as err:  # a read-only or full disk: said once; other hosts may judge it stale
                        if path not in self.unrefreshed:
                            log.warning("cannot refresh the heartbeat of %s (%s)", path, err.strerror)
                        self.unrefreshed.add(path)


_LEASES = _Leases()


def _registry() -> _Leases:
    global _LEASES
    if _LEASES.pid != os.getpid():  # a forked child holds nothing of its parent's
        _LEASES = _Leases()
    return _LEASES


def acquire(path: str | os.PathLike, what: str) -> None:
    """Hold the lease at `path` (`what` names it in messages) until `release` or the end of this process.
    Raises LeaseHeld naming the holder when a live process holds it; takes a stale one over with a log line."""
    path = Path(path)
    leases = _registry()
    with leases.lock:
        if path in leases.held:
            return
    me = _me()
    tmp = path.with_name(f".{path.name}.{me['host']}.{me['pid']}.tmp")
    for _ in range(5):
        tmp.write_text(json.dumps({**me, "since": time.time(), "what": what}))
        try:
            os.link(tmp, path)
            break
        except FileExistsError:
            holder = _read(path)
            if holder is None:  # removed just now by its holder
                continue
            if _same(holder, me):  # ours already, from an earlier object of this process
                break
            try:
                age = _age(path, tmp)
            except FileNotFoundError:
                continue
            why = _why_stale(holder, age)
            if why is None:
                raise LeaseHeld(f"{what} is in use by a live process: {describe(holder, age)}; stop it first, or "
                                "wait for it to end") from None
            log.warning("taking over %s from %s: %s", what, describe(holder, age), why)
            _break(path, holder)
        finally:
            tmp.unlink(missing_ok=True)
    else:
        raise LeaseHeld(f"could not take {what}: other processes keep taking it")
    with leases.lock:
        leases.held[path] = what
        if leases.thread is None:
            leases.thread = threading.Thread(target=leases.heartbeat, name="lease-heartbeat", daemon=True)
            leases.thread.start()


def _break(path: Path, judged: dict[str, Any]) -> None:
    """Remove a stale lease. Renamed aside first, so of two processes breaking it at once only one succeeds,
    and put back if what was moved is not the lease judged stale (a new holder won the race)."""
    aside = path.with_name(f".{path.name}.stale.{socket.gethostname()}.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read(aside) != judged:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
    aside.unlink(missing_ok=True)


def release(path: str | os.PathLike) -> None:
    path = Path(path)
    leases = _registry()
    with leases.lock:
        if leases.held.pop(path, None) is None:
            return
        holder = _read(path)
        if holder is not None and _same(holder, _me()):
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                if err.errno != errno.EROFS:
                    raise


def _holders(folder: Path, prefix: str = "") -> list[tuple[Path, dict[str, Any], str | None, float]]:
    """(path, holder, why stale or None, age) of every lease in `folder` named `prefix*` not held by this process."""
    me = _me()
    try:
        names = [n for n in os.listdir(folder) if not n.startswith(".") and n.startswith(prefix)]
    except FileNotFoundError:
        return []
    probe = folder / f".probe.{me['host']}.{me['pid']}"
    probe.write_text("")
    found = []
    try:
        for name in names:
            holder = _read(folder / name)
            if holder is None or _same(holder, me):
                continue
            try:
                age = _age(folder / name, probe)
            except FileNotFoundError:
                continue
            found.append((folder / name, holder, _why_stale(holder, age), age))
    finally:
        probe.unlink(missing_ok=True)
    return found


def any_live(folder: Path, prefix: str = "") -> bool:
    """Whether another live process holds a lease in `folder` named `prefix*`."""
    return any(why is None for _, _, why, _ in _holders(folder, prefix))


def check_free(folder: Path, what: str) -> None:
    """Raise LeaseHeld if a live process other than this one holds any lease in `folder`; stale leases there
    are removed with a log line (recovery then cleans up after their holders)."""
    for path, holder, why, age in _holders(folder):
        if why is None:
            raise LeaseHeld(f"{what} is in use: {holder.get('what', path.name)} is held by a live process "
                            f"({describe(holder, age)}); stop it first, or wait for it to end")
    for path, holder, why, age in _holders(folder):
        log.warning("%s: %s was left by %s: %s", what, holder.get("what", path.name), describe(holder, age), why)
        _break(path, holder)


def release_all() -> None:
    """Release every lease this process holds (at its end, and after a command run in-process)."""
    for path in list(_registry().held):
        try:
            release(path)
        except OSError:
            continue


atexit.register(release_all)
