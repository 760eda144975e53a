"""`python -m <pkg> profile`: the split of a step into its phases sums to the step, the FLOP count
is the model's, the verdict follows the data wait, and the trace is written. `find-batch-size`:
its search, its rules, its CPU sweep. find-lr and profile run in a ddp project without torchrun."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import pytest
import torch
from test_project import render, run
from waiting import wait_until

from scaffold.render import new_project


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    """The default project's package, imported from a fresh render: (its modules, its root)."""
    project = new_project(tmp_path_factory.mktemp("p") / "profproj", {}, git=False).path
    sys.path.insert(0, str(project / "src"))
    try:
        modules = {
            name.rpartition(".")[2]: importlib.import_module(f"profproj.{name}")
            for name in ("config", "tools.profiling", "tools.timing", "model", "data", "tools.tune")
        }
        yield modules, project
    finally:
        sys.path.remove(str(project / "src"))
        for name in [m for m in sys.modules if m == "profproj" or m.startswith("profproj.")]:
            del sys.modules[name]


def _cfg(modules, **fields):
    return modules["config"].Config(**fields)


def test_the_phase_timer_gives_each_phase_the_time_until_the_next_mark(proj):
    modules, _ = proj
    now = 100.0
    timer = modules["profiling"].PhaseTimer(torch.device("cpu"), clock=lambda: now)
    for phase, pause in [("data", 2.0), ("forward", 5.0), ("optimizer", 1.0), ("done", 50.0)]:
        timer(phase)
        now += pause  # after "done": counted nowhere, until the next step's first mark
    timer("data")
    now += 3.0
    timer("done")
    expected = {"data": 5.0, "copy": 0.0, "forward": 5.0, "backward": 0.0, "optimizer": 1.0}
    assert timer.seconds == expected


def test_the_flop_count_is_the_models_matmuls_forward_and_backward(proj, monkeypatch):
    modules, _ = proj
    profiling = modules["profiling"]
    cfg = _cfg(modules, batch_size=32, grad_accum_steps=2)
    splits = modules["data"].load_splits(cfg)
    engine = profiling.Engine(cfg, splits, torch.device("cpu"))
    x, y = splits.train.x[:32], splits.train.y[:32]
    batches = iter([(x, y), (x, y)])

    flops = profiling.step_flops(engine, batches, cfg, torch.device("cpu"))

    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    per_layer = [2 * 32 * m.in_features * m.out_features for m in linears]
    # forward, then the weight gradient of each layer and the input gradient of all but the first
    expected = 2 * (sum(per_layer) * 2 + sum(per_layer[1:]))
    assert flops == expected
    assert all(p.grad is None for p in engine.model.parameters())  # the counted step is undone


def test_profile_splits_a_real_step_and_writes_its_trace(proj, tmp_path):
    modules, _ = proj
    out = tmp_path / "profile"
    lines = modules["profiling"].profile(_cfg(modules), str(out)).splitlines()

    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and "ms" in line}
    phases = modules["profiling"].PHASES
    assert set(phases) <= set(rows)
    ms = {phase: float(rows[phase].split()[1]) for phase in phases}
    assert all(ms[p] > 0 for p in ("forward", "backward", "optimizer"))
    summed = next(line for line in lines if "phases sum" in line)
    total, synced = (
        float(summed.split()[2]),
        float(summed.split("synchronised step of ")[1].split()[0]),
    )
    assert total == pytest.approx(sum(ms.values()), rel=0.01)
    assert 0.95 <= total / synced <= 1.0  # the marks cover the step, within a few percent
    assert any(line.startswith("FLOPs: ") and "GFLOP/s achieved" in line for line in lines)
    assert any(line.startswith("verdict: not loader-bound") for line in lines)
    trace = json.loads((out / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names


def test_a_slow_loader_is_the_verdict(proj, tmp_path, monkeypatch):
    modules, _ = proj
    profiling, timing = modules["profiling"], modules["timing"]
    fast = timing.micro_batches  # profiling draws its batches through timing.training_batches
    lines = profiling.profile(_cfg(modules), str(tmp_path / "fast")).splitlines()
    phases = next(line for line in lines if "synchronised step of " in line)
    step = float(phases.split("synchronised step of ")[1].split()[0])  # ms
    wait = max(0.02, 2 * step / 1000)  # twice a step (4 ms idle, 70x that on a loaded machine)

    def slow(*args, **kwargs):
        for batch in fast(*args, **kwargs):
            time.sleep(wait)  # a decode in the main process
            yield batch

    monkeypatch.setattr(timing, "micro_batches", slow)
    lines = profiling.profile(_cfg(modules), str(tmp_path / "p")).splitlines()

    verdict = next(line for line in lines if line.startswith("verdict: "))
    assert verdict.startswith("verdict: loader-bound: waiting for data is")
    data = next(line for line in lines if line.startswith("  data "))
    assert float(data.split()[1]) >= wait * 1000  # ms a step


@pytest.mark.slow
def test_profile_and_find_lr_run_in_a_ddp_project_without_torchrun(tmp_path):
    project = render(tmp_path / "ddpprof", distributed="ddp", tracker="tensorboard")

    done = run(project, "profile", "--max-steps", "50")
    assert done.returncode == 0, done.stderr
    assert "verdict: " in done.stdout
    traces = list((project / "runs" / "profile" / "tensorboard").glob("*.pt.trace.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]

    done = run(project, "find-lr", "--range-steps", "20", "-o", tmp_path / "lr.png")
    assert done.returncode == 0, done.stderr
    assert "suggested --lr" in done.stdout
    assert not Path(project / "runs" / "default").exists()


@pytest.fixture(scope="module")
def tune(proj):
    return proj[0]["tune"]


@pytest.mark.parametrize(("start", "threshold"), [(256, 40_000), (256, 300), (256, 100), (8, 8)])
def test_the_batch_search_finds_the_largest_fit_in_few_probes(cuda_tune, start, threshold):
    probes = []

    def fits(size):
        probes.append(size)
        return size <= threshold

    best = cuda_tune.largest_fitting(fits, start)

    assert best <= threshold
    assert threshold - best <= max(1, best // 16)  # bisected to within 1/16
    assert len(probes) <= 2 * (threshold.bit_length() + 4)  # doubling and halving, then bisecting
    assert threshold + 1 not in probes or not fits(threshold + 1)


def test_the_batch_search_says_0_when_nothing_fits_and_stops_at_its_limit(cuda_tune):
    assert cuda_tune.largest_fitting(lambda size: False, 64) == 0
    assert cuda_tune.largest_fitting(lambda size: True, 64, limit=1000) == 1000


def test_the_rescaling_rules(tune):
    assert tune.rescaled_lr(0.003, 256, 1024) == pytest.approx(0.006)  # square root of 4
    assert tune.accumulation_for(1024, 300) == (256, 4)
    assert tune.accumulation_for(1024, 2048) == (1024, 1)
    assert tune.accumulation_for(1000, 512, world_size=2) == (500, 1)


def test_find_batch_size_on_the_cpu_measures_throughput_and_suggests_options(
    proj, tune, monkeypatch
):
    modules, _ = proj
    monkeypatch.setattr(tune, "CPU_BATCHES", (8, 16, 32, 64))
    lines = tune.find_batch_size(_cfg(modules), global_batch=96).splitlines()

    assert lines[0].startswith("find-batch-size on cpu: no device memory to fill")
    rows = [line for line in lines if line.startswith("  batch ")]
    assert [int(r.split()[1].rstrip(":")) for r in rows] == [8, 16, 32, 64]
    rates = {int(r.split()[1].rstrip(":")): float(r.split()[2].replace(",", "")) for r in rows}
    best = max(rates, key=rates.get)
    assert f"fastest per sample: --batch-size {best} " in lines[-2]
    size, steps = tune.accumulation_for(96, best)
    assert f"--batch-size {size} --grad-accum-steps {steps} " in lines[-1]


def test_a_cpu_project_has_no_memory_search_and_no_memory_flag(proj, tune):
    """A CPU's memory does not bound the micro-batch: the search and its --memory-target exist in
    cuda and mps projects only (cuda_tune below), not switched off in a CPU one."""
    _, project = proj
    assert not hasattr(tune, "largest_fitting") and not hasattr(tune, "MEMORY_TARGET")
    main = (project / "src" / "profproj" / "__main__.py").read_text()
    sizer = main.split('"find-batch-size"')[1].split("add_parser")[0]  # its parser's lines
    assert "--global-batch" in sizer and "memory" not in sizer


def _cuda_module(tmp_path_factory, package: str, answers: dict, module: str):
    """A module of a freshly rendered cuda project, imported on this CPU machine, and removed
    from sys.modules after the tests that use it."""
    answers = {"device": "cuda", "precision": "bf16", **answers}
    project = new_project(tmp_path_factory.mktemp("c") / package, answers, git=False).path
    sys.path.insert(0, str(project / "src"))
    try:
        yield importlib.import_module(f"{package}.{module}")
    finally:
        sys.path.remove(str(project / "src"))
        for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def cuda_device(tmp_path_factory):
    yield from _cuda_module(tmp_path_factory, "cudaproj", {}, "runtime.device")


def test_the_gpu_utilisation_is_the_mean_of_samples_taken_during_the_window(cuda_device):
    readings = iter([10, 30] * 1000)
    with cuda_device.UtilizationSampler(torch.device("cuda"), read=lambda: next(readings)) as gpu:
        assert wait_until(lambda: len(gpu.samples) >= 3, timeout=30)  # read while the window runs
    assert len(gpu.samples) >= 4  # and once more as it ends
    assert gpu.mean == pytest.approx(sum(gpu.samples) / len(gpu.samples))
    assert 10 <= gpu.mean <= 30


def test_without_nvml_or_off_cuda_the_gpu_utilisation_is_unknown(cuda_device):
    def no_nvml():
        raise ModuleNotFoundError("pynvml")

    with cuda_device.UtilizationSampler(torch.device("cuda"), read=no_nvml) as gpu:
        assert wait_until(lambda: not gpu.enabled, timeout=30)  # its first reading failed
    assert gpu.mean is None
    with cuda_device.UtilizationSampler(torch.device("cpu")) as gpu:
        assert not gpu.enabled  # no thread started: nothing to wait for
    assert gpu.mean is None and not gpu.samples


@pytest.fixture(scope="module")
def cuda_tune(tmp_path_factory):
    yield from _cuda_module(tmp_path_factory, "cudatune", {"task": "generation"}, "tools.tune")


class _FakeGPU:
    """torch.cuda's memory calls, for a step whose peak is `size` MiB: what _memory_search reads."""

    def __init__(self, monkeypatch, tune):
        self.peak = 0
        gib = 2**30
        properties = type("Properties", (), {"total_memory": 8 * gib})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Fake GPU")
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: self.peak)
        monkeypatch.setattr(tune.hardware, "synchronize", lambda device: None)


def test_the_gpu_search_takes_a_kernels_failure_at_a_size_as_its_limit_not_the_codes(
    cuda_tune, monkeypatch
):
    """On an H200 (torch 2.11), cuDNN attention's backward failed at a large batch with a
    RuntimeError that is not an out-of-memory error: the search took it for a bug and died.
    A size above one that ran is now that size's limit, said in its line; a failure before any
    size ran is still the code's own and raised."""
    gpu = _FakeGPU(monkeypatch, cuda_tune)
    cudnn = "Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good()"

    def step(size):
        if size > 300:
            raise RuntimeError(f"{cudnn} to be true, but got false.\n(Could this be improved?)")
        gpu.peak = size * 2**20

    cfg = cuda_tune.Config(batch_size=32, lr=1e-3, grad_accum_steps=1)
    engine = type("Engine", (), {"optimizer": torch.optim.SGD([torch.zeros(1)], lr=0.1)})()
    cuda = torch.device("cuda")
    out = cuda_tune._memory_search(cfg, cuda, engine, step, None, 0.9, limit=100_000)

    assert f"  batch     512: failed ({cudnn} to be true, but got false.)" in out.splitlines()
    best = int(out.split("largest micro-batch under 90%: ")[1].split()[0])
    assert 300 - best <= max(1, best // 16) and best <= 300
    assert "suggested: --batch-size" in out

    def broken(size):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        cuda_tune._memory_search(cfg, cuda, engine, broken, None, 0.9, limit=100_000)

    def out_of_memory(size):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    out = cuda_tune._memory_search(cfg, cuda, engine, out_of_memory, None, 0.9, limit=100_000)
    assert "  batch      32: out of memory" in out.splitlines()
    assert out.splitlines()[-1] == (  # the training rules' remedies in order, those that apply
        "not even a micro-batch of 1 fits: next, --activation-checkpointing 1 (a resumed run"
        " may add it); then scaffold update . --distributed fsdp, on several GPUs (each holds 1/N"
        " of the model)"
    )


def test_find_batch_size_reports_the_largest_micro_batch_with_and_without_recomputed_blocks(
    cuda_tune, monkeypatch
):
    """A step's peak is 1 MiB an example kept, a quarter of it with every block recomputed: the
    search runs for both, and the second's suggestion carries the flag."""
    gpu = _FakeGPU(monkeypatch, cuda_tune)  # 8 GiB
    engine = type("Engine", (), {"optimizer": torch.optim.SGD([torch.zeros(1)], lr=0.1)})()

    def sizing(cfg):
        def step(size):
            gpu.peak = size * 2**20 // (4 if cfg.activation_checkpointing else 1)

        return torch.device("cuda"), engine, step, 100_000

    monkeypatch.setattr(cuda_tune, "_sizing", sizing)
    out = cuda_tune.find_batch_size(cuda_tune.Config(batch_size=32), target=0.5).splitlines()
    largest = [line for line in out if line.startswith("largest micro-batch")]
    assert len(largest) == 2 and largest[0].startswith("largest micro-batch under 50%: ")
    recomputing = "largest micro-batch under 50% with --activation-checkpointing 1: "
    assert largest[1].startswith(recomputing)
    kept, recomputed = (int(line.split(": ")[1].split()[0]) for line in largest)
    assert 4096 * 15 / 16 <= kept <= 4096 and 4 * 4096 * 15 / 16 <= recomputed <= 4 * 4096
    suggested = f"suggested: --activation-checkpointing 1 --batch-size {recomputed} --lr "
    assert out[-1].startswith(suggested)


def test_out_of_memory_in_train_ends_in_one_line_with_the_remedies_in_order(tmp_path):
    """A cuda project on the CPU (--device cpu), its model raising CUDA's out-of-memory error at
    the third forward: one line naming the step and the next flags, exit 1, no traceback."""
    project = new_project(tmp_path / "oom", {"device": "cuda", "precision": "fp32"}, git=False).path
    model = project / "src" / "oom" / "model.py"
    text = model.read_text()
    old = "        return self.head(self.body(x))"
    assert old in text
    raising = (
        '        self.calls = getattr(self, "calls", 0) + 1\n'
        "        if self.calls == 3:\n"
        '            raise torch.cuda.OutOfMemoryError("CUDA out of memory")\n'
    )
    model.write_text(text.replace(old, raising + old))
    done = run(project, "train", "--device", "cpu", "--max-steps", "5", "--batch-size", "48")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: out of memory at step 3, a micro-batch of 48 on cpu: next, --batch-size 24"
        " --grad-accum-steps 2 (same global batch; new --run-dir); then"
        " --activation-checkpointing 1 (a resumed run may add it); then scaffold update ."
        " --distributed fsdp, on several GPUs (each holds 1/N of the model)"
    )
