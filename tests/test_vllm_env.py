"""scripts/vllm-env where no disk holds vLLM's environment: `make vllm-env` fails and says how much each place has,
`make test` (`--if-room`) goes on without it, leaving nothing half-built behind."""

from __future__ import annotations

import os
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
