"""The cluster launchers rendered beside the SLURM script of a ddp or fsdp project: a Kubeflow
Trainer TrainJob (scripts/train_kubeflow.yaml) and a SkyPilot task (scripts/train_skypilot.yaml).
Here: each is what its engine reads (the TrainJob and its volume claim through the Trainer's own
API models, kubeflow-trainer-api, offline), for the options chosen (GPUs only under cuda), and runs
scripts/train_multi_node.sh with the engine's variables handed on. tests/test_ddp.py and
tests/test_fsdp.py run their commands as 2 nodes on this machine (tests/launchers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from launchers import k8s_name, manifest
from test_project import render

GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="module")
def cpu_ddp(tmp_path_factory) -> Path:
    """A cpu ddp project whose name Kubernetes would refuse as is (capitals, '.', '_')."""
    return render(tmp_path_factory.mktemp("launch") / "My.Run_2", distributed="ddp")


@pytest.fixture(params=["cpu_ddp", "cuda_fsdp"])
def project(request) -> Path:
    if request.param == "cuda_fsdp":
        return GOLDEN / "everything"  # cuda, fsdp; tests/test_golden.py keeps it current
    return request.getfixturevalue(request.param)


def _cuda(project: Path) -> bool:
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text(encoding="utf-8"))
    return answers["device"] == "cuda"


def test_the_kubeflow_manifest_is_a_trainjob_on_torch_distributed_with_its_volume(project):
    claim, job = manifest(project, "kubeflow")
    # The API models drop what they do not know: a misspelt field would not come back.
    from kubeflow_trainer_api import models  # here: importing it took a sixth of the collection

    assert models.TrainerV1alpha1TrainJob.from_dict(job).to_dict() == job
    assert models.IoK8sApiCoreV1PersistentVolumeClaim.from_dict(claim).to_dict() == claim

    name = k8s_name(project)
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["metadata"]["name"] == name
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 2
    assert trainer["numProcPerNode"] == (8 if _cuda(project) else 2)
    assert ("resourcesPerNode" in trainer) == _cuda(project)
    if _cuda(project):
        assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8"}
    script = trainer["command"][2]
    for theirs, ours in [("PET_MASTER_ADDR", "MASTER_ADDR"), ("PET_MASTER_PORT", "MASTER_PORT"),
                         ("PET_NNODES", "NNODES"), ("PET_NODE_RANK", "NODE_RANK"),
                         ("PET_NPROC_PER_NODE", "NPROC_PER_NODE")]:  # fmt: skip
        assert f'{ours}="${theirs}"' in script
    assert "exec scripts/train_multi_node.sh" in script
    # The Trainer refuses a TrainJob that sets torchrun's variables itself.
    assert not any(e["name"].startswith("PET_") for e in trainer.get("env", []))

    (patch,) = job["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"  # the torch-distributed runtime's replicated job
    pod = node["template"]["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every node writes and reads it
    (mount,) = pod["containers"][0]["volumeMounts"]
    assert trainer["args"][1].startswith(mount["mountPath"] + "/")  # --run-dir on the volume


def test_the_skypilot_task_runs_the_script_on_its_nodes_with_a_bucket_for_the_runs(project):
    (task,) = manifest(project, "skypilot")
    assert task["num_nodes"] == 2 and task["workdir"] == "."
    assert ("accelerators" in task["resources"]) == _cuda(project)
    assert task["envs"] == {"RUNS_BUCKET": None}  # SkyPilot refuses to launch until it is given
    assert task["file_mounts"] == {"/runs": {"name": "${RUNS_BUCKET}", "mode": "MOUNT_CACHED"}}
    run = task["run"]
    assert f"--run-dir /runs/{k8s_name(project)}" in run
    for theirs, ours in [("SKYPILOT_NUM_NODES", "NNODES"), ("SKYPILOT_NODE_RANK", "NODE_RANK")]:
        assert f'{ours}="${theirs}"' in run
    assert 'MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n 1)"' in run
    assert ('NPROC_PER_NODE="$SKYPILOT_NUM_GPUS_PER_NODE"' in run) == _cuda(project)
    assert "exec scripts/train_multi_node.sh" in run


def test_a_project_without_torchrun_has_no_launchers():
    assert not (GOLDEN / "default" / "scripts").exists()
