"""`dflash-stream bench regenerate`: how fast each generation engine writes the target's answers, and whether they
are the answers in-process `generate` writes.

The same prompts (the first N of the data, rendered by the project's own pipeline with data.regenerate on, from
configs/demo.yaml by default), the same token budget, greedy, for each engine:

- `hf`: in-process `model.generate` (`target_model/generate.py`, what data.generation.engine hf runs), in
  length-sorted batches of data.generation.batch_size, as the extractor asks it;
- `vllm`: vLLM's OpenAI server from its own environment (`make vllm-env`: the CPU build pins an older
  transformers), asked through `CompletionClient` as engine openai asks it (token ids in and out);
- `transformers`: `transformers serve --continuous-batching`, asked the same way (it takes no token ids, so the
  client sends text and tokenizes the answers: counted as `from_text`).

Servers load a folder of safetensors: a GGUF target (the demo's) is converted once, dequantized, into the cache
that every load of it reads after (`gguf_cache`). Their start-up (and one warm-up request) is not timed, only the
generation; one server runs at a time, so no two engines compete for the cores. `agree_with_hf` counts the answers
identical token for token to hf's: greedy decoding in other kernels may take another branch where two logits nearly
tie, and an answer that comes back as text may tokenize otherwise (`retokenize_differs` counts the id answers for
which it would). Both servers take at most 2,048 tokens per step (vLLM's CPU default), and `transformers serve`
gets a KV cache sized for the prompts: on CPU it would otherwise reserve 60 % of the machine's RAM.

On a small CPU machine the thread settings decide the figures, so each engine's entry says what it used: hf runs
`--threads` torch threads (default: every core); `transformers serve` gets the same through OMP_NUM_THREADS; vLLM's
CPU server binds its OpenMP threads itself (VLLM_CPU_OMP_THREADS_BIND). Left to itself (`--vllm-bind auto`) it keeps
one core for its API server and scheduler, so on two cores it would compute on one while hf computes on two; the
bench's default (`all`) has it compute on every core, as the others do, its API server sharing them as hf's Python
loop does. `cores` is the cores an engine occupies, the divisor of `tokens_per_s_per_core`. The bench's own client
(HTTP, tokenizing) runs on the same cores as the servers.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_stream.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from dflash_stream.data import PreparedSample

ENGINES = ("hf", "vllm", "transformers")
VLLM_ENV_COMMAND = "make vllm-env"


@dataclass
class BenchOptions:
    prompts: int = 64
    max_new_tokens: int = 64
    engines: Sequence[str] = ENGINES
    endpoints: Sequence[str] = ()
    """Servers already running, measured as they are (named by URL in the result)."""
    concurrency: int | None = None
    """Requests in flight per server; default: all the prompts."""
    batch_size: int | None = None
    """hf: prompts per `generate` call; default: data.generation.batch_size."""
    threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    vllm_bind: str = "all"
    """all (`threads` cores compute, none kept: what hf gets), or a VLLM_CPU_OMP_THREADS_BIND value: auto (vLLM's
    default: one core kept for its API server), nobind, or a CPU list such as 0-1."""
    workdir: Path = Path("runs/bench-regenerate")
    startup_timeout_s: float = 600.0
    vllm_python: Path | None = None
    """The vLLM environment's python; default `.venv-vllm/bin/python` in the current folder."""


def register_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("regenerate", help="answers per second of hf generate, vLLM and transformers serve on "
                                              "the same prompts, and how many agree with hf token for token")
    bench.add_argument("--config", default="configs/demo.yaml",
                       help="run config whose target and data are used (default configs/demo.yaml)")
    bench.add_argument("--prompts", type=int, default=64, help="the first N prompts of the data (default 64)")
    bench.add_argument("--max-new-tokens", type=int, default=64, help="answer budget per prompt (default 64)")
    bench.add_argument("--engines", default=",".join(ENGINES),
                       help=f"comma-separated, of {', '.join(ENGINES)} (default all)")
    bench.add_argument("--endpoint", action="append", default=[], metavar="URL",
                       help="also measure a server already running (yours: e.g. http://node0:8000/v1), with the "
                            "config's data.generation.model and api_key_env; its tok/s is what "
                            "data.generation.tokens_per_s takes. Repeatable; with --engines '' only these")
    bench.add_argument("--concurrency", type=int, default=None,
                       help="requests in flight per server (default: all the prompts at once)")
    bench.add_argument("--batch-size", type=int, default=None,
                       help="hf: prompts per generate call (default data.generation.batch_size)")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch threads of hf and transformers serve (default: every core this process may use)")
    bench.add_argument("--vllm-bind", default="all",
                       help="vLLM CPU thread binding: all (--threads cores compute, as for hf; the default), auto "
                            "(vLLM's default: one core kept for its API server), nobind, or a CPU list such as 0-1")
    bench.add_argument("--workdir", default="runs/bench-regenerate",
                       help="the converted target and the servers' logs (default runs/bench-regenerate)")
    bench.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to start")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=bench_regenerate)


def say(message: str) -> None:
    print(f"[bench regenerate] {message}", file=sys.stderr, flush=True)


def bench_regenerate(args: argparse.Namespace) -> int:
    from dflash_stream.config import endpoint_base_url

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not (engines or args.endpoint):
        raise ConfigError(f"--engines: {', '.join(unknown) or '(none)'}; allowed: {', '.join(ENGINES)}")
    try:
        endpoints = [endpoint_base_url(url) for url in args.endpoint]
    except ValueError as err:
        raise ConfigError(f"--endpoint: {err}") from None
    for name in ("prompts", "max_new_tokens", "concurrency", "batch_size", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: {value}; it must be at least 1")
    options = BenchOptions(prompts=args.prompts, max_new_tokens=args.max_new_tokens, engines=engines,
                           endpoints=endpoints,
                           concurrency=args.concurrency, batch_size=args.batch_size, vllm_bind=args.vllm_bind,
                           workdir=Path(args.workdir), startup_timeout_s=args.startup_timeout)
    if args.threads:
        options.threads = args.threads
    result = run_bench(load_config(args.config), options)
    print(json.dumps(result, indent=2) if args.json else "\n".join(table(result)))
    return 1 if any("error" in entry for entry in result["engines"].values()) else 0


def run_bench(cfg: Config, options: BenchOptions) -> dict[str, Any]:
    """Every engine of `options` on the same prompts; the figures as `--json` prints them."""
    import torch

    from dflash_stream.regenerate.servers import safetensors_copy
    from dflash_stream.target_model.loading import load_tokenizer

    if not cfg.data.regenerate:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"regenerate": True})})
    tokenizer = load_tokenizer(cfg.target)
    samples = bench_prompts(cfg, tokenizer, options.prompts)
    say(f"{len(samples)} prompts of {min(s.num_tokens for s in samples)}-{max(s.num_tokens for s in samples)} "
        f"tokens, up to {options.max_new_tokens} new tokens each, greedy; engines {', '.join(options.engines)}")
    torch.set_num_threads(options.threads)
    engines: dict[str, dict[str, Any]] = {}
    hf_answers: dict[int, list[int]] | None = None
    model = None
    if "hf" in options.engines:
        engines["hf"], hf_answers, model = run_hf(cfg, samples, options)
    servers = [e for e in options.engines if e != "hf"]
    if servers:
        model_dir = safetensors_copy(cfg.target, tokenizer, model)
        del model  # the servers get the memory and the cores
        gc.collect()
        for kind in servers:
            engines[kind] = run_server(kind, cfg, tokenizer, model_dir, samples, options, hf_answers)
    for url in options.endpoints:
        engines[url] = run_endpoint(url, cfg, tokenizer, samples, options, hf_answers)
    return {"prompts": len(samples), "max_new_tokens": options.max_new_tokens, "engines": engines}


def bench_prompts(cfg: Config, tokenizer, count: int) -> list[PreparedSample]:
    """The first `count` prompts of the data in extraction order, rendered as regeneration renders them."""
    from dflash_stream.data.prepare import prepare_samples

    samples, _ = prepare_samples(cfg, tokenizer, 0, 1)
    samples = [s for s in samples if s.needs_response][:count]
    if not samples:
        raise ConfigError("data: no prompt to answer (every row was skipped); see `dflash-stream data`")
    if len(samples) < count:
        say(f"the data hold {len(samples)} prompts, fewer than --prompts {count}: all of them are used")
    return samples


# -- hf: in-process generate ----------------------------------------------------------------------------------


def run_hf(cfg: Config, samples: list[PreparedSample], options: BenchOptions
           ) -> tuple[dict[str, Any], dict[int, list[int]], Any]:
    """(figures, answers by sample id, the loaded model: reused to convert a GGUF target for the servers)."""
    import torch

    from dflash_stream.target_model.generate import generate_responses
    from dflash_stream.target_model.loading import load_target, stop_token_ids

    gen = cfg.data.generation.model_copy(update={"temperature": 0.0})
    batch_size = options.batch_size or gen.batch_size
    say(f"hf: loading the target ({options.threads} torch threads, batches of {batch_size})")
    model, tokenizer = load_target(cfg.target, torch.device("cpu"))
    # Untimed: the first generate call pays one-off costs (allocator, kernel selection) no later one does.
    generate_responses(model, tokenizer, [samples[0].input_ids], gen, 2)
    # Length-sorted batches, as the extractor builds them: the least padding a static batch can have.
    ordered = sorted(samples, key=lambda s: s.num_tokens)
    answers: dict[int, list[int]] = {}
    started = time.perf_counter()
    for first in range(0, len(ordered), batch_size):
        chunk = ordered[first:first + batch_size]
        responses = generate_responses(model, tokenizer, [s.input_ids for s in chunk], gen, options.max_new_tokens)
        answers.update({s.sample_id: r for s, r in zip(chunk, responses, strict=True)})
    seconds = time.perf_counter() - started
    tokens = sum(len(r) for r in answers.values())
    stops = stop_token_ids(model, tokenizer)
    entry = _figures(tokens, seconds, len(answers), len(answers), cores=options.threads)
    entry.update(threads=options.threads, batch_size=batch_size, dtype=str(model.dtype).removeprefix("torch."),
                 truncated=sum(not r or r[-1] not in stops for r in answers.values()))
    say(f"hf: {tokens:,} tokens in {seconds:.1f} s ({entry['tokens_per_s']:,.1f} tok/s)")
    return entry, answers, model


# -- the servers ------------------------------------------------------------------------------------------------


def run_server(kind: str, cfg: Config, tokenizer, model_dir: Path, samples: list[PreparedSample],
               options: BenchOptions, hf_answers: dict[int, list[int]] | None) -> dict[str, Any]:
    """Start one server, warm it up, time the answers to `samples`, stop it (also on error or interrupt)."""
    from dflash_stream.regenerate.servers import (
        BATCH_TOKENS,
        KV_BLOCK,
        LocalServer,
        ServerError,
        kv_cache_gib,
        vllm_binding,
        vllm_python,
        vllm_server,
        vllm_thread_env,
    )
    from dflash_stream.target_model.loading import resolve_dtype

    dtype = str(resolve_dtype(cfg.target, _cpu())).removeprefix("torch.")
    longest = max(s.num_tokens for s in samples) + options.max_new_tokens
    extra: dict[str, Any] = {}
    log_path = options.workdir / "logs" / f"{kind}.log"
    if kind == "vllm":
        python = options.vllm_python or vllm_python()
        if not python.exists():
            say(f"vllm: skipped, {python} not found")
            return {"skipped": f"no vLLM environment ({python} not found)", "command": VLLM_ENV_COMMAND}
        _, extra["bind"] = vllm_thread_env(options.vllm_bind, options.threads)
        # Room for every prompt at once, so the server is measured at the concurrency it is asked for.
        server = vllm_server(model_dir, log_path, dtype=dtype, max_model_len=longest, threads=options.threads,
                             bind=options.vllm_bind, kv_cache_gib=kv_cache_gib(cfg.target, len(samples) * longest),
                             python=python)
    else:
        extra["threads"] = options.threads
        # On CPU, continuous batching sizes its KV cache at 60 % of the machine's RAM unless told otherwise: a
        # cache for every prompt at once is enough, and leaves room for the rest of the machine. A batch holds
        # as many tokens as vLLM's CPU server takes per step (its default for the API server).
        server = LocalServer(kind, model_dir, log_path, extra_args=("--dtype", dtype, "--cb-max-batch-tokens",
                                                                    str(BATCH_TOKENS)),
                             kv_tokens=len(samples) * (math.ceil(longest / KV_BLOCK) + 1) * KV_BLOCK,
                             env={"OMP_NUM_THREADS": str(options.threads)})
    log_path.unlink(missing_ok=True)  # the log read back below is this run's
    with server:
        say(f"{kind}: starting its server on {model_dir} (log {log_path})")
        started = time.perf_counter()
        try:
            server.start()
            server.wait_ready(options.startup_timeout_s)
        except ServerError as err:
            say(f"{kind}: {err}")
            return {"error": str(err).splitlines()[0], "log": str(log_path)}
        client = _client(cfg, tokenizer, server.url, options.concurrency or len(samples))
        _ask(client, samples[:1], 2)  # untimed warm-up; it also settles the client's dialect for this server
        startup = time.perf_counter() - started
        say(f"{kind}: ready after {startup:.0f} s; generating")
        started = time.perf_counter()
        answers = _ask(client, samples, options.max_new_tokens)
        seconds = time.perf_counter() - started
    if kind == "vllm":
        binding = vllm_binding(log_path.read_text(errors="replace")) if log_path.is_file() else None
        if binding:
            extra.update(omp_threads=len(binding[0]), compute_cores=binding[0], reserved_cores=binding[1])
            cores = len(set(binding[0]) | set(binding[1]))
        else:
            cores = options.threads
    else:
        cores = options.threads
    entry = _served_figures(answers, seconds, hf_answers, cores, client.concurrency)
    entry.update(startup_seconds=round(startup, 1), **extra, dtype=dtype)
    say(f"{kind}: {entry['tokens']:,} tokens in {seconds:.1f} s ({entry['tokens_per_s']:,.1f} tok/s)"
        + (f", {entry['agree_with_hf']} of {len(hf_answers)} as hf's" if hf_answers is not None else ""))
    return entry


def run_endpoint(url: str, cfg: Config, tokenizer, samples: list[PreparedSample], options: BenchOptions,
                 hf_answers: dict[int, list[int]] | None) -> dict[str, Any]:
    """A server already running (its cores unknown here): the same prompts after one untimed warm-up request."""
    client = _client(cfg, tokenizer, url, options.concurrency or len(samples), as_configured=True)
    _ask(client, samples[:1], 2)
    say(f"{url}: generating")
    started = time.perf_counter()
    answers = _ask(client, samples, options.max_new_tokens)
    seconds = time.perf_counter() - started
    entry = _served_figures(answers, seconds, hf_answers, None, client.concurrency)
    entry["model"] = client.endpoints[0].model
    say(f"{url}: {entry['tokens']:,} tokens in {seconds:.1f} s ({entry['tokens_per_s']:,.1f} tok/s): set "
        f"data.generation.tokens_per_s to it for `plan` (at concurrency {client.concurrency})")
    return entry


def _served_figures(answers: list, seconds: float, hf_answers: dict[int, list[int]] | None, cores: int | None,
                    concurrency: int) -> dict[str, Any]:
    """A server's figures from its answers: speed, agreement with hf's answers, and how the answers came."""
    good = {a.key: a.tokens for a in answers if a.tokens is not None}
    agree = None if hf_answers is None else sum(good.get(k) == v for k, v in hf_answers.items())
    entry = _figures(sum(len(t) for t in good.values()), seconds, len(good), agree, cores=cores)
    entry.update(from_text=sum(a.from_text for a in answers),
                 retokenize_differs=sum(a.retokenize_differs for a in answers),
                 errors=sum(a.tokens is None for a in answers),
                 truncated=sum(a.finish == "length" for a in answers), concurrency=concurrency)
    return entry


def _cpu():
    import torch

    return torch.device("cpu")


def _client(cfg: Config, tokenizer, url: str, concurrency: int, as_configured: bool = False):
    from dflash_stream.config import GenerationConfig
    from dflash_stream.regenerate.client import CompletionClient
    from dflash_stream.target_model.loading import target_stop_ids

    # A local server serves the converted folder under its path; the user's, the name and key of the config.
    own = {} if as_configured else {"model": None, "api_key_env": None}
    gen = GenerationConfig(**{**cfg.data.generation.model_dump(), "engine": "openai", "endpoints": [url],
                              "temperature": 0.0, **own})
    # No data.max_length check: the bench's prompts and answers fit the server it starts by construction.
    return CompletionClient(gen, tokenizer, target_stop_ids(cfg.target, tokenizer), concurrency,
                            target=cfg.target.model)


def _ask(client, samples: list[PreparedSample], max_tokens: int) -> list:
    from dflash_stream.regenerate.client import Prompt

    answers: list = []
    client.run([Prompt(s.sample_id, s.input_ids.tolist(), max_tokens) for s in samples], answers.append)
    return answers


# -- output ---------------------------------------------------------------------------------------------------


def _figures(tokens: int, seconds: float, responses: int, agree: int | None, cores: int | None
             ) -> dict[str, Any]:
    rate = tokens / max(seconds, 1e-9)
    return {"tokens_per_s": round(rate, 1), "seconds": round(seconds, 2), "responses": responses,
            "agree_with_hf": agree, "tokens": tokens, "cores": cores,
            "tokens_per_s_per_core": round(rate / cores, 1) if cores else None}


def table(result: dict[str, Any]) -> list[str]:
    """The engines side by side, with the speed of each as a multiple of hf's."""
    engines = result["engines"]
    base = (engines.get("hf") or {}).get("tokens_per_s")
    lines = [f"{result['prompts']} prompts, up to {result['max_new_tokens']} new tokens each, greedy",
             f"{'engine':<13}{'tok/s':>9}{'seconds':>9}{'responses':>11}{'agree w/ hf':>13}{'x hf':>7}"
             f"{'cores':>7}{'tok/s/core':>12}  notes"]
    for name, e in engines.items():
        if "tokens_per_s" not in e:
            why = e.get("skipped") or e.get("error")
            lines.append(f"{name:<13}{'-':>9}  " + why + (f"; make it with `{e['command']}`" if "command" in e else ""))
            continue
        agree = "-" if e["agree_with_hf"] is None else f"{e['agree_with_hf']}/{e['responses']}"
        per_core = "-" if e["tokens_per_s_per_core"] is None else f"{e['tokens_per_s_per_core']:,.1f}"
        speed = f"{e['tokens_per_s'] / base:.2f}" if base else "-"
        notes = []
        if "startup_seconds" in e:
            notes.append(f"start-up {e['startup_seconds']:.0f} s (untimed)")
        if "threads" in e:
            notes.append(f"{e['threads']} threads")
        if "bind" in e:
            notes.append(e["bind"] + (f" (computes on {e['compute_cores']}, keeps {e['reserved_cores']})"
                                      if "compute_cores" in e else ""))
        if e.get("from_text"):
            notes.append(f"{e['from_text']} answers as text")
        if e.get("errors"):
            notes.append(f"{e['errors']} errors")
        lines.append(f"{name:<13}{e['tokens_per_s']:>9,.1f}{e['seconds']:>9.1f}{e['responses']:>11}{agree:>13}"
                     f"{speed:>7}{e['cores'] or '-':>7}{per_core:>12}  {'; '.join(notes)}")
    return lines
