#!/usr/bin/env python3
"""The GPU readiness kit: the wheels a GPU machine's image lacks, carried in (it has no network).

    build   (here)   pip download the pinned cp312 manylinux x86_64 wheels into KIT and write KIT/manifest.json
                     (with the Gated-DeltaNet kernels hybrid targets need on CUDA: fla-core and einops)
    verify  (either) every wheel of the manifest is there, intact (sha256), for CPython 3.12 on x86_64 Linux,
                     and the kit stays under its size limit
    install (there)  the required wheels, and each fallback wheel the running interpreter lacks (or has too old),
                     with `pip install --no-index --no-deps --target DIR`: never over the image's own torch

The versions are the ones installed where `build` runs (the project's tested environment). Standard library only:
`install` runs before anything in the kit is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

PYTHON_VERSION = "3.12"
ABI = "cp312"
# glibc 2.28 or newer on the GPU image (Ubuntu 24.04 has 2.39); numpy 2.4 ships manylinux_2_28 wheels only.
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"]
LIMIT_BYTES = 50 * 2**20
# What the GPU image lacks: the store's codecs (zarr 3.1 needs donfig, google-crc32c, numcodecs), the config's
# pydantic, and pytest for `pytest -m gpu`. Always installed.
REQUIRED = [
    "zarr", "numcodecs", "google-crc32c", "donfig",
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "pytest", "pluggy", "iniconfig", "pygments",
]
# Dependencies of the above that the image normally has (torch and transformers need them): installed only
# where the interpreter lacks them or has a version below the one these packages require.
FALLBACKS = {"numpy": "2.0", "packaging": "24.0", "typing-extensions": "4.16.0", "pyyaml": "5.1"}
# Kernels for hybrid targets' Gated-DeltaNet layers (transformers imports `fla` when it loads Qwen3.5/3.6):
# pure-Python Triton kernels, pinned here because they are not installed on the CPU machine (they need CUDA).
# Installed where the interpreter lacks them or has an older version. causal-conv1d has no wheel on the
# index (an sdist compiled against the CUDA torch), so the kit cannot carry it; transformers' torch conv serves.
KERNELS = {"fla-core": "0.6.0", "einops": "0.8.2"}
WHEEL_TAG = re.compile(r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


class KitError(Exception):
    """One line saying what is wrong with the kit."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_tuple(version: str) -> tuple[int, ...]:
    """The numeric release part of a version (`2.4.6` -> (2, 4, 6); `0.8.1.post1` -> (0, 8, 1))."""
    parts = []
    for piece in version.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:
            break
    return tuple(parts)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wheel_fits(filename: str) -> bool:
    """A wheel CPython 3.12 on x86_64 Linux can load: pure `py3-none-any`, or cp312 (or abi3) manylinux x86_64."""
    match = WHEEL_TAG.search(filename)
    if match is None:
        return False
    py, abi, plat = match["py"].split("."), match["abi"].split("."), match["plat"].split(".")
    if "any" in plat:
        return any(p in ("py3", "py312", "cp312") for p in py)
    return ABI in py and (ABI in abi or "abi3" in abi) and any(
        p.startswith("manylinux") and p.endswith("x86_64") for p in plat
    )


def _wheel_name_version(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return canonical(name), version


# ---------------------------------------------------------------------------------------------------------- build
def build(kit: Path) -> dict:
    """Download every kit wheel at the version installed here; write and return the manifest."""
    pins = []
    for name in [*REQUIRED, *FALLBACKS]:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise KitError(f"{name} is not installed here (run `make setup` first): the kit pins what is") from None
    pins += [f"{name}=={version}" for name, version in KERNELS.items()]
    kit.mkdir(parents=True, exist_ok=True)
    for old in kit.glob("*.whl"):
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", ABI,
           *[arg for plat in PLATFORMS for arg in ("--platform", plat)], "--dest", str(kit), *pins]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise KitError(f"pip download failed ({done.returncode}): {tail[0]}")
    wheels = []
    for path in sorted(kit.glob("*.whl")):
        name, version = _wheel_name_version(path.name)
        role = "fallback" if name in FALLBACKS else "kernel" if name in KERNELS else "required"
        entry = {"file": path.name, "name": name, "version": version, "sha256": sha256(path),
                 "bytes": path.stat().st_size, "role": role}
        if role != "required":
            entry["min_version"] = FALLBACKS.get(name) or KERNELS[name]
        wheels.append(entry)
    manifest = {"python_version": PYTHON_VERSION, "platforms": PLATFORMS, "wheels": wheels,
                "total_bytes": sum(w["bytes"] for w in wheels)}
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    verify(kit)
    return manifest


# --------------------------------------------------------------------------------------------------------- verify
def verify(kit: Path) -> dict:
    """The manifest, after checking the kit against it; raises KitError naming the first problem."""
    path = kit / "manifest.json"
    if not path.is_file():
        raise KitError(f"{path} not found: run `make gpu-kit` on the CPU machine first (and carry {kit.name})")
    manifest = json.loads(path.read_text())
    names = {w["name"] for w in manifest["wheels"]}
    missing = sorted({canonical(n) for n in [*REQUIRED, *FALLBACKS, *KERNELS]} - names)
    if missing:
        raise KitError(f"the kit lacks {', '.join(missing)}: run `make gpu-kit` again")
    for wheel in manifest["wheels"]:
        file = kit / wheel["file"]
        if not file.is_file():
            raise KitError(f"{file} is missing: run `make gpu-kit` again")
        if file.stat().st_size != wheel["bytes"] or sha256(file) != wheel["sha256"]:
            raise KitError(f"{file.name} differs from the manifest (damaged or replaced): run `make gpu-kit` again")
        if not wheel_fits(wheel["file"]):
            raise KitError(f"{file.name} is not a wheel for CPython {PYTHON_VERSION} on x86_64 Linux")
    total = sum(w["bytes"] for w in manifest["wheels"])
    if total > LIMIT_BYTES:
        raise KitError(f"the kit holds {total / 2**20:.1f} MiB of wheels, over its {LIMIT_BYTES // 2**20} MiB limit")
    return manifest


# -------------------------------------------------------------------------------------------------------- install
def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def choose(manifest: dict, fallbacks: str) -> list[dict]:
    """The wheels to install: every required one; fallbacks and kernels by `auto` (this interpreter lacks the
    package or has one older than `min_version`), `all` or `none`."""
    chosen = []
    for wheel in manifest["wheels"]:
        if wheel["role"] in ("fallback", "kernel"):
            have = installed_version(wheel["name"])
            too_old = have is None or version_tuple(have) < version_tuple(wheel["min_version"])
            if fallbacks == "none" or (fallbacks == "auto" and not too_old):
                continue
        chosen.append(wheel)
    return chosen


def _unpack(wheel: Path, target: Path) -> None:
    """What `pip install --target` does with these wheels, for an interpreter without pip: unzip into the
    target, moving `*.data/purelib|platlib` contents to its top."""
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            parts = Path(member).parts
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts and headers: not needed to import the package
                dest = target.joinpath(*parts[2:])
            else:
                dest = target / member
            if member.endswith("/"):
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(zf.read(member))


def install(kit: Path, target: Path, fallbacks: str = "auto", cross: bool = False) -> list[str]:
    """Install the chosen wheels into `target`; returns their file names. `cross` lets this machine's pip put
    the cp312 wheels into a folder (a rehearsal of the GPU side on another Python)."""
    manifest = verify(kit)
    chosen = choose(manifest, fallbacks)
    target.mkdir(parents=True, exist_ok=True)
    files = [str(kit / w["file"]) for w in chosen]
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if not has_pip:
        for file in files:
            _unpack(Path(file), target)
        return [w["file"] for w in chosen]
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--target", str(target), "--upgrade"]
    if cross:
        cmd += ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", ABI, "--only-binary=:all:",
                *[arg for plat in PLATFORMS for arg in ("--platform", plat)]]
    done = subprocess.run([*cmd, *files], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise KitError(f"pip install --target {target} failed ({done.returncode}): {tail[0]}")
    return [w["file"] for w in chosen]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_kit.py", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["build", "verify", "install"])
    parser.add_argument("--kit", default=".gpu-kit", help="the kit folder (default .gpu-kit)")
    parser.add_argument("--target", help="install: the private folder to install into")
    parser.add_argument("--fallbacks", choices=["auto", "all", "none"], default="auto")
    parser.add_argument("--cross", action="store_true", help="install: cp312 wheels with another Python's pip")
    args = parser.parse_args(argv)
    kit = Path(args.kit)
    try:
        if args.action == "build":
            manifest = build(kit)
            print(f"{kit}: {len(manifest['wheels'])} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB "
                  f"(limit {LIMIT_BYTES // 2**20} MiB)")
        elif args.action == "verify":
            manifest = verify(kit)
            for w in manifest["wheels"]:
                print(f"{w['role']:8s} {w['name']}=={w['version']}  {w['bytes'] / 2**20:6.2f} MiB")
            print(f"ok: {len(manifest['wheels'])} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB")
        else:
            if not args.target:
                parser.error("install needs --target DIR")
            installed = install(kit, Path(args.target), args.fallbacks, args.cross)
            print(f"installed {len(installed)} wheel(s) into {args.target}: {' '.join(installed)}")
    except KitError as err:
        print(f"gpu_kit: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
