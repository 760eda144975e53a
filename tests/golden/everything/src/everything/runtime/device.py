"""Machinery: the CUDA GPU, this project's device (or the CPU, with --device cpu). The set-up, the
timings, the profiler and find-batch-size ask this module what differs from one device to another:
TF32 and deterministic cuBLAS, waiting for queued kernels, the GPU's utilisation (NVML), its peak
FLOP/s and its memory.
"""

import os
import threading

import torch

from ..config import Config

# Dense tensor-core peaks from the vendor's data sheets, in TFLOP/s: bf16 and fp16, and TF32
# (what fp32 matmuls run as here: configure allows TF32). The first name found in the device's
# name counts, so "H100 PCIe" comes before "H100" (the SXM part).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0},
}


def configure(deterministic: bool) -> None:
    """TF32 matmuls, and deterministic kernels if asked."""
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)  # CPU reductions then add in one fixed order


def synchronize(device: torch.device) -> None:
    """Waits for queued GPU work, so that timings measure it (the CPU runs ops in order)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_utilization(device: torch.device, timed) -> tuple:
    """timed()'s result, and the GPU's mean utilisation while it ran (n/a with --device cpu, or
    without NVML)."""
    with UtilizationSampler(device) as gpu:
        result = timed()
    return result, "n/a" if gpu.mean is None else f"{gpu.mean:.0f}% (sampled while the steps ran)"


class UtilizationSampler:
    """The GPU's utilisation read every SAMPLE_EVERY seconds in a thread while a timed window runs
    (and once as it ends): their mean, not one reading taken after the work. torch reads it
    through NVML, which needs the nvidia-ml-py package; without it, or off CUDA, the mean is None."""

    SAMPLE_EVERY = 0.05  # seconds; NVML itself averages over its own sampling period

    def __init__(self, device: torch.device, read=None) -> None:
        self.read = read or (lambda: torch.cuda.utilization(device))
        self.enabled = read is not None or device.type == "cuda"
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def __enter__(self) -> "UtilizationSampler":
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            self._sample()

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.SAMPLE_EVERY) and self.enabled:
            self._sample()

    def _sample(self) -> None:
        try:
            self.samples.append(float(self.read()))
        except (ModuleNotFoundError, RuntimeError):  # no nvidia-ml-py, or NVML unavailable
            self.enabled = False

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples and self.enabled else None


def mfu(achieved: float, device: torch.device, precision: str) -> str:
    """The model FLOP utilisation against the GPU's peak for this precision, when known."""
    if device.type != "cuda":
        return ""
    name = torch.cuda.get_device_name(device)
    peak = next((p for part, p in PEAK_TFLOPS.items() if part in name), None)
    if peak is None:
        return f"; MFU n/a (no peak listed for {name} in PEAK_TFLOPS)"
    peak = peak[precision] * 1e12
    return f"; MFU {achieved / peak:.1%} of the {name}'s {peak / 1e12:g} TFLOP/s {precision}"


def profiler_view(device: torch.device) -> tuple[list, str]:
    """The activities torch.profiler records, and the column its table sorts by."""
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    return ([cpu, cuda], "self_cuda_time_total") if device.type == "cuda" else ([cpu], "self_cpu_time_total")


def memory(device: torch.device) -> tuple[str, int]:
    """The GPU's name and its memory in bytes."""
    return torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory


def empty_cache(device: torch.device) -> None:
    """Frees the allocator's cached blocks, and starts the peak over."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """Bytes at the peak since empty_cache."""
    return torch.cuda.max_memory_allocated(device)


def out_of_memory(error: RuntimeError) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError)


def out_of_memory_remedies(cfg: Config) -> str:
    """What to run next when a micro-batch does not fit, as flags, in the training rules' order:
    a smaller micro-batch with more accumulation (the same global batch), activation checkpointing,
    then sharding with FSDP."""
    remedies = []
    if cfg.batch_size > 1:
        size = next(size for size in range(cfg.batch_size // 2, 0, -1) if cfg.batch_size % size == 0)
        steps = cfg.grad_accum_steps * cfg.batch_size // size
        remedies.append(f"--batch-size {size} --grad-accum-steps {steps} (same global batch; new --run-dir)")
    if cfg.activation_checkpointing != 1:
        remedies.append("--activation-checkpointing 1 (a resumed run may add it)")
    return "; then ".join(remedies) or "a smaller model: every remedy of the training rules is in use"
