"""What this machine has, found without importing torch (which takes seconds to import).

The accelerator decides two defaults of copier.yml (device and precision); guessing wrong is
cheap, since every project runs with `--device cpu` too and the answers can be changed, so when
a sign is missing or unclear the answer is the one that always works: cpu, and fp16 on a CUDA GPU
whose compute capability is unknown (every CUDA GPU runs fp16; bf16 needs compute capability 8.0).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# A GPU as old as this or newer computes in bf16 (NVIDIA Ampere).
_BF16_COMPUTE_CAPABILITY = (8, 0)
_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    device: str  # cpu, cuda or mps
    cuda_precision: str  # bf16 or fp16: what a cuda project defaults to here
    evidence: str  # how that was found, for `scaffold options`


@functools.cache
def accelerator() -> Accelerator:
    """This machine's accelerator, as the installed torch would see it."""
    build = _torch_build()
    if sys.platform == "darwin":
        if platform.machine() == "arm64" and _macos_at_least(12, 3):
            return Accelerator(device="mps", cuda_precision="bf16", evidence="Apple silicon")
        return _cpu(f"a Mac without Apple silicon ({platform.machine()})")
    if build is None:
        return _cpu("torch is not installed here")
    if build.endswith("+cpu"):
        return _cpu(f"torch {build} is built without CUDA")
    gpus = _nvidia_smi()
    if gpus:
        name, capability = gpus[0]
        bf16 = capability is not None and capability >= _BF16_COMPUTE_CAPABILITY
        shown = "unknown" if capability is None else ".".join(map(str, capability))
        return Accelerator(
            device="cuda",
            cuda_precision="bf16" if bf16 else "fp16",
            evidence=f"nvidia-smi lists {name}, compute capability {shown}",
        )
    if _NVIDIA_GPUS.is_dir() and any(_NVIDIA_GPUS.iterdir()):
        return Accelerator(
            device="cuda",
            cuda_precision="fp16",
            evidence=f"{_NVIDIA_GPUS} lists a GPU (no nvidia-smi: compute capability unknown)",
        )
    return _cpu("no NVIDIA GPU found (nvidia-smi, /proc/driver/nvidia), not a Mac")


def device_available(device: str) -> bool:
    """Whether this machine can run on `device` (cpu, cuda or mps), as far as it can tell."""
    return device == "cpu" or device == accelerator().device


def _cpu(why: str) -> Accelerator:
    return Accelerator(device="cpu", cuda_precision="bf16", evidence=why)


def _torch_build() -> str | None:
    """The installed torch's version, such as 2.13.0+cpu (its local part names the build)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> list[tuple[str, tuple[int, int] | None]]:
    """(name, compute capability) of each GPU nvidia-smi lists; [] without a working one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = ["--query-gpu=name,compute_cap", "--format=csv,noheader"]
    try:
        ran = subprocess.run(
            [smi, *query], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if ran.returncode != 0:
        return []
    gpus = []
    for line in ran.stdout.splitlines():
        name, _, cap = (part.strip() for part in line.rpartition(","))
        major, dot, minor = cap.partition(".")
        capability = (int(major), int(minor)) if dot and (major + minor).isdigit() else None
        gpus.append((name or line.strip(), capability))
    return gpus


def _macos_at_least(major: int, minor: int) -> bool:
    parts = platform.mac_ver()[0].split(".")
    try:
        return (int(parts[0]), int(parts[1]) if len(parts) > 1 else 0) >= (major, minor)
    except ValueError:
        return False


def importable_top_level_names() -> list[str]:
    """Standard-library modules and top-level names importable in this environment: a project
    package with one of these names would shadow it. The working directory is left out: it is
    where the command runs, not the environment the project will run in.

    Read from the folders of sys.path (a listing each), not from every installed distribution's
    metadata, which takes a fifth of a second with a few hundred packages installed."""
    cwd = {"", ".", os.getcwd()}
    names = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
    for folder in sys.path:
        if folder in cwd:
            continue
        try:
            entries = os.scandir(folder)
        except OSError:
            continue
        with entries:
            for entry in entries:
                name = _module_name(entry)
                if name:
                    names.add(name)
    return sorted(names)


def _module_name(entry: os.DirEntry[str]) -> str | None:
    """The top-level module an entry of a sys.path folder provides, if any."""
    name = entry.name
    if entry.is_dir():
        return name if name.isidentifier() else None
    stem, dot, suffix = name.partition(".")
    if dot and stem.isidentifier() and (suffix == "py" or suffix.endswith(("so", "pyd"))):
        return stem
    return None
