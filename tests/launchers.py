"""The cluster launchers of a ddp or fsdp project (scripts/train_kubeflow.yaml, scripts/
train_skypilot.yaml), run on this machine as their engines would run them: the command each
manifest gives its nodes, taken from the parsed YAML, once per node, with the variables that
engine sets on that node.

What each engine sets on a node, and where that was checked:
- Kubeflow Trainer v2.3.0: the torch plugin (kubeflow/trainer pkg/runtime/framework/plugins/torch/
  torch.go, names and port in pkg/constants/constants.go) sets PET_NNODES (numNodes),
  PET_NPROC_PER_NODE (numProcPerNode), PET_NODE_RANK (the Job completion index), PET_MASTER_ADDR
  (<job>-node-0-0.<job>, pod 0) and PET_MASTER_PORT (29500; a free port here, so runs on one
  machine do not meet), and rejects a TrainJob whose trainer.env sets any of them; the runtime's
  replicated job and container are both named `node` (manifests/base/runtimes/
  torch_distributed.yaml). The user guide: kubeflow.org/docs/components/trainer/.
- SkyPilot (docs.skypilot.co: running-jobs/environment-variables, running-jobs/distributed-jobs;
  sky/backends/task_codegen.py in skypilot 0.14.1): SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK,
  SKYPILOT_NODE_IPS (one address a line, the head node's first) and SKYPILOT_NUM_GPUS_PER_NODE
  (0 for a task without GPUs). It sets no port: the script's default is 29500.

Used by tests/test_ddp.py and tests/test_fsdp.py with their projects and reference runs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

LAUNCHERS = ("kubeflow", "skypilot")
STOPPED = re.compile(r"^stopped at step (\d+) by SIGTERM; checkpoint ", re.MULTILINE)
SIGNALLED_AT = 23  # between checkpoints 20 and 30


def k8s_name(project: Path) -> str:
    return re.sub(r"[_.]", "-", project.name.lower())


def manifest(project: Path, launcher: str) -> list[dict]:
    text = (project / "scripts" / f"train_{launcher}.yaml").read_text(encoding="utf-8")
    return list(yaml.safe_load_all(text))


def node_command(project: Path, launcher: str, args: list[str]) -> list[str]:
    """The command the manifest runs on each node, its training options replaced by `args`."""
    name = k8s_name(project)
    if launcher == "kubeflow":
        trainer = manifest(project, launcher)[-1]["spec"]["trainer"]
        assert trainer["args"] == ["--run-dir", f"/runs/{name}", "--max-steps", "5000"], trainer
        return [*trainer["command"], *args]
    run = manifest(project, launcher)[0]["run"]
    shown = f"--run-dir /runs/{name} --max-steps 5000"
    assert run.count(shown) == 1, run
    return ["bash", "-c", run.replace(shown, " ".join(args))]


def node_env(launcher: str, rank: int, nodes: int, nproc: int, port: int) -> dict[str, str]:
    """What the engine sets on node `rank` (every node on this machine, 127.0.0.1)."""
    if launcher == "kubeflow":
        return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(nproc),
                "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port)}  # fmt: skip
    ips = "\n".join(f"127.0.0.{i + 1}" for i in range(nodes))
    return {"SKYPILOT_NUM_NODES": str(nodes), "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            # not SkyPilot's: the port (its default 29500 is taken by other tests' runs) and,
            # without GPUs to count, the processes a node (the script's default is 2)
            "MASTER_PORT": str(port), "NPROC_PER_NODE": str(nproc)}  # fmt: skip


def run_nodes(
    project: Path,
    launcher: str,
    args: list[str],
    env: dict[str, str],
    port: int,
    sigterm_after: int | None = None,
    timeout: float = 300,
) -> tuple[list[int], str, str]:
    """Runs the launcher's command as 2 nodes of 1 process on this machine; with `sigterm_after`,
    both get SIGTERM once rank 0 logs that step (as when the job's pods or nodes are stopped).
    Returns both exit statuses and the two nodes' output."""
    path = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    command = node_command(project, launcher, args)
    with tempfile.TemporaryFile("w+") as second:
        nodes = [
            subprocess.Popen(command, cwd=project, text=True, stderr=subprocess.STDOUT,
                             stdout=subprocess.PIPE if rank == 0 else second,
                             env={**env, "PATH": path, **node_env(launcher, rank, 2, 1, port)})
            for rank in (0, 1)
        ]  # fmt: skip
        output, deadline = [], time.monotonic() + timeout
        try:
            for line in nodes[0].stdout:
                output.append(line)
                if sigterm_after is not None and line.startswith(f"step {sigterm_after}/"):
                    for node in nodes:
                        node.send_signal(signal.SIGTERM)
                    sigterm_after = None
                if time.monotonic() > deadline:
                    break
            for node in nodes:
                node.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()  # torchrun's workers follow their launcher (parent-death signal)
                    node.wait()
        second.seek(0)
        return [node.returncode for node in nodes], "".join(output), second.read()


def stop_and_resume(project, launcher, args, env, reference: Path, port) -> None:
    """The launcher's job, 2 nodes x 1 process: SIGTERM to both nodes once rank 0 logs step
    SIGNALLED_AT (a pod deleted, a node preempted) stops every rank at one step with its
    checkpoint, and both end with 128 + SIGTERM and no traceback; the same command then resumes
    and ends with `reference`'s records, bit for bit. `port()` gives a free port."""
    run_dir = project / args[args.index("--run-dir") + 1]
    stopped, log, other = run_nodes(project, launcher, args, env, port(), SIGNALLED_AT)
    both = log[-3000:] + "\n--- node 1 ---\n" + other[-3000:]
    found = STOPPED.findall(log)
    assert len(found) == 1 and int(found[0]) > SIGNALLED_AT, both  # rank 0 alone says it
    step = int(found[0])

    resumed, again, again_other = run_nodes(project, launcher, args, env, port())
    assert resumed == [0, 0], again[-3000:] + "\n--- node 1 ---\n" + again_other[-3000:]
    assert f"at step {step}\n" in again, again[-3000:]
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    assert metrics == (reference / "metrics.jsonl").read_bytes()  # bit for bit
    # how the stopped job ended, last: that is the launch path's part (torchrun's exit)
    assert "Traceback" not in log + other, both
    assert stopped == [143, 143], both
