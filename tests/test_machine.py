"""The accelerator is found without importing torch, and unclear signs give the safe default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scaffold import machine


@pytest.fixture
def found(monkeypatch):
    """accelerator() on a machine described by the arguments, instead of this one."""

    def describe(*, platform="linux", arch="x86_64", torch="2.13.0", smi=(), proc_gpus=False):
        machine.accelerator.cache_clear()
        monkeypatch.setattr(machine.sys, "platform", platform)
        monkeypatch.setattr(machine.platform, "machine", lambda: arch)
        monkeypatch.setattr(machine.platform, "mac_ver", lambda: ("14.4", ("", "", ""), arch))
        monkeypatch.setattr(machine, "_torch_build", lambda: torch)
        monkeypatch.setattr(machine, "_nvidia_smi", lambda: list(smi))
        monkeypatch.setattr(machine, "_NVIDIA_GPUS", _Gpus(proc_gpus))
        return machine.accelerator()

    yield describe
    machine.accelerator.cache_clear()


class _Gpus:
    def __init__(self, present: bool):
        self.present = present

    def is_dir(self) -> bool:
        return self.present

    def iterdir(self):
        return iter(["0000:01:00.0"] if self.present else [])

    def __str__(self) -> str:
        return "/proc/driver/nvidia/gpus"


def test_an_ampere_gpu_defaults_to_cuda_and_bf16(found):
    got = found(smi=[("NVIDIA A100-SXM4-40GB", (8, 0))])

    assert (got.device, got.cuda_precision) == ("cuda", "bf16")
    assert "nvidia-smi lists NVIDIA A100-SXM4-40GB, compute capability 8.0" in got.evidence


def test_an_older_gpu_defaults_to_fp16(found):
    got = found(smi=[("Tesla T4", (7, 5))])

    assert (got.device, got.cuda_precision) == ("cuda", "fp16")


def test_a_gpu_without_nvidia_smi_is_cuda_with_the_precision_every_gpu_runs(found):
    got = found(proc_gpus=True)

    assert (got.device, got.cuda_precision) == ("cuda", "fp16")
    assert "compute capability unknown" in got.evidence


def test_a_cpu_build_of_torch_means_cpu_even_beside_a_gpu(found):
    got = found(torch="2.13.0+cpu", smi=[("NVIDIA A100", (8, 0))])

    assert got.device == "cpu"
    assert "2.13.0+cpu" in got.evidence


@pytest.mark.parametrize(
    ("kwargs", "device"),
    [
        ({"platform": "darwin", "arch": "arm64"}, "mps"),
        ({"platform": "darwin", "arch": "x86_64"}, "cpu"),
        ({}, "cpu"),
        ({"torch": None, "proc_gpus": True}, "cpu"),
    ],
)
def test_other_machines(found, kwargs, device):
    assert found(**kwargs).device == device


def test_nvidia_smi_output_is_read(monkeypatch):
    listing = "NVIDIA H200, 9.0\nTesla, K80, 3.7\nOdd GPU, [N/A]\n"
    monkeypatch.setattr(machine.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(
        machine.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a, 0, listing, ""),
    )

    assert machine._nvidia_smi() == [
        ("NVIDIA H200", (9, 0)),
        ("Tesla, K80", (3, 7)),
        ("Odd GPU", None),
    ]


def test_finding_the_defaults_does_not_import_torch():
    code = (
        "import sys; from scaffold import questions, _cli; questions.machine_facts(); "
        "questions.resolved_defaults(); print('torch' in sys.modules)"
    )
    repo = Path(__file__).resolve().parent.parent
    ran = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )

    assert ran.stdout.strip() == "False"
