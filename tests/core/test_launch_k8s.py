"""``loongforge launch k8s``: the manifests validate against the Kubernetes and CRD schemas, and start what they say.

No cluster is reachable here, so nothing is applied. Instead every document is validated the way the API server
would with strict field validation (``kubectl apply --validate=strict``): core objects (the ConfigMap, JobSet's Job
template, the PyTorchJob pod template) against kubernetes-validate's strict Kubernetes 1.33 schemas, and the custom
resources against the ``openAPIV3Schema`` of their CRDs, vendored under ``data/k8s/`` (see its README), with unknown
fields refused as the API server refuses them. CEL rules (``x-kubernetes-validations``) and admission webhooks are
not evaluated. The torchrun command of each pod is parsed by torch's own launcher parser, under the pod's
environment, so the node count, ranks per node and rendezvous endpoint asserted are the ones torchrun would use.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from loongforge.cli import main
from loongforge.config import load_config

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
CRDS = Path(__file__).parent / "data" / "k8s"
KUBERNETES = "1.33"
KINDS = ("jobset", "pytorchjob", "trainjob")
#: Pod 0's DNS name for a workload named "quickstart": JobSet names pods <jobset>-<replicated job>-<job>-<pod>
#: under a headless service named after the JobSet (a TrainJob's JobSet is named after it, replicated job "node");
#: the Training Operator gives the PyTorchJob master the service <job>-master-0.
RENDEZVOUS = {"jobset": "quickstart-node-0-0.quickstart:29500", "trainjob": "quickstart-node-0-0.quickstart:29500",
              "pytorchjob": "quickstart-master-0:29500"}


def launch(capsys, *argv: str) -> tuple[int, str, str]:
    """``loongforge launch k8s ARGV`` in this process: exit status, stdout, stderr."""
    status = main(["launch", "k8s", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def manifests(capsys, *argv: str) -> list[dict[str, Any]]:
    status, out, err = launch(capsys, *argv)
    assert status == 0, err
    assert "&id" not in out and "*id" not in out, "no YAML anchors/aliases"
    return list(yaml.safe_load_all(out))


def standard(kind: str, *extra: str) -> list[str]:
    return [str(QUICKSTART), "training.steps=50", "parallel.tp=4", "--nodes", "3", "--gpus-per-node", "4",
            "--image", "registry.example/loongforge-cuda:0.5.0", "--kind", kind, "--checkpoint-pvc", "shared-ckpt",
            "--cpu", "32", "--memory", "256Gi", "--max-restarts", "5", "--grace-period", "420", *extra]


def strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields: the API server prunes or (strict) rejects fields a structural
    schema does not list, where plain JSON Schema would accept them."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (({name: strict(sub) for name, sub in value.items()}) if key == "properties" else strict(value))
           for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    validators = {}
    for path in CRDS.glob("*.json"):
        vendored = json.loads(path.read_text())
        validators[(vendored["apiVersion"], vendored["kind"])] = jsonschema.Draft7Validator(strict(vendored["schema"]))
    return validators


VALIDATORS = crd_validators()


def validate(document: dict[str, Any]) -> None:
    """Raise unless ``document`` is valid: a core object through kubernetes-validate (strict), a custom resource
    through its CRD's schema, and the core objects a custom resource embeds as those core kinds."""
    key = (document["apiVersion"], document["kind"])
    if key not in VALIDATORS:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
        return
    VALIDATORS[key].validate(document)
    spec = document["spec"]
    if document["kind"] == "JobSet":
        for replicated in spec["replicatedJobs"]:
            kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "probe"},
                                          "spec": replicated["template"]["spec"]}, KUBERNETES, strict=True)
    if document["kind"] == "PyTorchJob":
        for replica in spec["pytorchReplicaSpecs"].values():
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "probe"},
                                          "template": replica["template"]}, KUBERNETES, strict=True)


def pod_specs(workload: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(pods, pod spec) per pod template of a JobSet or PyTorchJob."""
    spec = workload["spec"]
    if workload["kind"] == "JobSet":
        return [(job["replicas"] * job["template"]["spec"]["parallelism"], job["template"]["spec"]["template"]["spec"])
                for job in spec["replicatedJobs"]]
    return [(replica["replicas"], replica["template"]["spec"]) for replica in spec["pytorchReplicaSpecs"].values()]


def trainer_container(workload: dict[str, Any]) -> dict[str, Any]:
    if workload["kind"] == "TrainJob":
        return workload["spec"]["trainer"]
    (_, pod), *_ = pod_specs(workload)
    (container,) = pod["containers"]
    return container


def torchrun(container: dict[str, Any], monkeypatch) -> Any:
    """The pod's torchrun options as torch's launcher parses them (its ``PET_*`` variables included)."""
    from torch.distributed.run import parse_args

    assert container["command"] == ["python3", "-m", "loongforge.cluster.agent"]  # torchrun, keeping rank statuses
    for variable in container["env"]:
        monkeypatch.setenv(variable["name"], variable["value"])
    return parse_args(container["args"])


@pytest.mark.parametrize("kind", KINDS)
def test_every_document_validates_against_the_kubernetes_and_crd_schemas(kind, capsys):
    documents = manifests(capsys, *standard(kind))
    assert [(d["apiVersion"], d["kind"]) for d in documents][0] == ("v1", "ConfigMap")
    assert len(documents) == 2
    for document in documents:
        validate(document)


@pytest.mark.parametrize("kind", KINDS)
def test_the_validation_refuses_unknown_fields_and_wrong_types(kind, capsys):
    """The controls: the same validation fails on a misspelled field and on a count given as a string."""
    _, workload = manifests(capsys, *standard(kind))
    misspelled, wrong_type = copy.deepcopy(workload), copy.deepcopy(workload)
    if kind == "trainjob":
        misspelled["spec"]["trainer"]["numNode"] = 3
        wrong_type["spec"]["trainer"]["numNodes"] = "3"
    else:
        pod_specs(misspelled)[0][1]["terminationGracePeriod"] = 420
        pod_specs(wrong_type)[0][1]["terminationGracePeriodSeconds"] = "420"
    for broken in (misspelled, wrong_type):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "dat": {}}
    with pytest.raises(jsonschema.ValidationError):
        validate(config_map)


@pytest.mark.parametrize("kind", KINDS)
def test_nodes_gpus_and_rendezvous_are_what_torchrun_gets(kind, capsys, monkeypatch):
    _, workload = manifests(capsys, *standard(kind))
    container = trainer_container(workload)
    if kind == "trainjob":
        trainer = workload["spec"]["trainer"]
        assert (trainer["numNodes"], trainer["numProcPerNode"]) == (3, 4)
        assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 4}
    else:
        specs = pod_specs(workload)
        assert sum(pods for pods, _ in specs) == 3
        for _, pod in specs:
            (each,) = pod["containers"]
            assert each["resources"] == {"limits": {"nvidia.com/gpu": 4}, "requests": {"cpu": "32", "memory": "256Gi"}}
            assert each["args"] == container["args"]  # every pod runs the same command
    if kind == "pytorchjob":
        assert [(r, s["replicas"]) for r, s in workload["spec"]["pytorchReplicaSpecs"].items()] == \
            [("Master", 1), ("Worker", 2)]
        assert workload["spec"]["nprocPerNode"] == "4"
    if kind == "jobset":  # pod 0's name, from JobSet's naming of what the manifest declares
        replicated = workload["spec"]["replicatedJobs"][0]
        assert replicated["template"]["spec"]["completionMode"] == "Indexed"
        name = workload["metadata"]["name"]
        assert f"{name}-{replicated['name']}-0-0.{name}:29500" == RENDEZVOUS[kind]
    options = torchrun(container, monkeypatch)
    assert (options.nnodes, options.nproc_per_node) == ("3", "4")
    assert (options.rdzv_backend, options.rdzv_endpoint, options.rdzv_id) == ("c10d", RENDEZVOUS[kind], "quickstart")
    assert options.max_restarts == 5
    assert "SIGUSR1" in options.signals_to_handle.split(",") and "SIGTERM" in options.signals_to_handle.split(",")
    assert 0 < options.shutdown_timeout < 420  # the save after SIGTERM ends before the grace period does
    assert options.module and options.training_script == "loongforge.cli"
    assert options.training_script_args == ["train", "/etc/loongforge/config.yaml", "training.steps=50",
                                            "parallel.tp=4", "checkpoint.resume=auto",
                                            "run.output_dir=/mnt/loongforge/quickstart"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_pods_mount_the_config_and_the_checkpoint_volume(kind, capsys, monkeypatch, tmp_path):
    config_map, workload = manifests(capsys, *standard(kind))
    assert config_map["data"] == {"config.yaml": QUICKSTART.read_text()}
    if kind == "trainjob":
        (patch,) = workload["spec"]["runtimePatches"]
        (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        pod = job["template"]["spec"]["template"]["spec"]
        (patched,) = pod["containers"]
        assert (job["name"], patched["name"]) == ("node", "node")  # the torch-distributed runtime's names
        mounts = patched["volumeMounts"]
    else:
        pod = pod_specs(workload)[0][1]
        mounts = pod["containers"][0]["volumeMounts"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounted = {mount["mountPath"]: volumes[mount["name"]] for mount in mounts}
    assert mounted["/etc/loongforge"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert mounted["/mnt/loongforge"]["persistentVolumeClaim"] == {"claimName": "shared-ckpt"}
    assert mounted["/dev/shm"]["emptyDir"] == {"medium": "Memory"}
    assert pod["terminationGracePeriodSeconds"] == 420

    # What the pods train: the mounted file plus the command line's overrides.
    options = torchrun(trainer_container(workload), monkeypatch)
    command, config_path, *overrides = options.training_script_args
    assert command == "train" and Path(config_path).parent.as_posix() in mounted
    (tmp_path / "config.yaml").write_text(config_map["data"]["config.yaml"])
    config = load_config(tmp_path / "config.yaml", overrides)
    assert (config.training.steps, config.parallel.tp, config.checkpoint.resume) == (50, 4, "auto")
    assert config.run.output_dir == "/mnt/loongforge/quickstart" and config.checkpoint.dir is None


def test_restart_and_backoff_policies(capsys):
    _, jobset = manifests(capsys, *standard("jobset"))
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 5
    assert policy["rules"] == [
        {"name": "errors-to-fix-are-not-restarted", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": ["failed with exit code 2 matching FailJob rule"]},
        {"name": "preemption-restarts-for-free", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"]}]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    assert job["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]}}]

    _, pytorchjob = manifests(capsys, *standard("pytorchjob"))
    assert pytorchjob["spec"]["runPolicy"]["backoffLimit"] == 5
    assert {spec["restartPolicy"] for spec in pytorchjob["spec"]["pytorchReplicaSpecs"].values()} == {"ExitCode"}


def test_one_node_without_a_volume_warns_and_uses_an_empty_dir(capsys):
    status, out, err = launch(capsys, str(QUICKSTART), "--nodes", "1", "--gpus-per-node", "2", "--image", "img:1",
                              "--name", "solo", "--namespace", "research", "--accelerator-resource",
                              "kunlunxin.com/xpu")
    assert status == 0 and err.startswith("warning: no --checkpoint-pvc") and err.count("\n") == 1
    config_map, jobset = yaml.safe_load_all(out)
    for document in (config_map, jobset):
        validate(document)
        assert document["metadata"]["namespace"] == "research"
    pod = pod_specs(jobset)[0][1]
    assert {v["name"]: v for v in pod["volumes"]}["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}
    assert pod["containers"][0]["resources"] == {"limits": {"kunlunxin.com/xpu": 2},  # requests from the config
                                                 "requests": {"cpu": "8", "memory": "32Gi"}}
    assert "--rdzv-endpoint=solo-node-0-0.solo:29500" in pod["containers"][0]["args"]


BAD = [
    (["--nodes", "0"], "--nodes must be >= 1, got 0"),
    (["--nodes", "two"], "argument --nodes: invalid int value: 'two'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--kind", "deployment"], "argument --kind: invalid choice: 'deployment'"),
    (["--cpu", "3 cores"], "--cpu '3 cores' is not a Kubernetes quantity"),
    (["--memory", "lots"], "--memory 'lots' is not a Kubernetes quantity"),
    (["--name", "Bad_Name"], "--name 'Bad_Name' must be a lower-case DNS name"),
    (["--grace-period", "10"], "--grace-period must be >= 60, got 10"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["parallel.tp=5"], "tp*pp*cp*dp must equal the 12 processes started"),
    (["training.stepz=3"], "unknown key 'training.stepz'"),
    (["checkpoint.dir=/tmp/ckpt"], "checkpoint.dir '/tmp/ckpt' is not on the checkpoint volume"),
    (["run.output_dir=/tmp/out"], "launch k8s sets run.output_dir"),
]


@pytest.mark.parametrize(("extra", "message"), BAD, ids=[message.split(":")[0][:40] for _, message in BAD])
def test_bad_flags_and_configs_are_one_line(extra, message, capsys):
    argv = [str(QUICKSTART), "--nodes", "3", "--gpus-per-node", "4", "--image", "img:1", "--checkpoint-pvc", "ck"]
    if extra[0] == "--nodes":
        argv[2] = extra[1]
        extra = []
    status, out, err = launch(capsys, *argv, *extra)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_a_bad_config_file_and_a_missing_volume_are_one_line(capsys, tmp_path):
    broken = tmp_path / "run.yaml"
    broken.write_text("model: llama-tiny\ntraining: {steps: 2}\ntraining: {steps: 5}\n")
    for argv, message in (
        ([str(broken), "--nodes", "1", "--gpus-per-node", "1", "--image", "i:1"], "duplicate key 'training'"),
        ([str(tmp_path / "none.yaml"), "--nodes", "1", "--gpus-per-node", "1", "--image", "i:1"], "not found"),
        ([str(QUICKSTART), "--nodes", "2", "--gpus-per-node", "1", "--image", "i:1"],
         "--nodes 2 needs --checkpoint-pvc"),
        ([str(QUICKSTART), "--nodes", "1", "--gpus-per-node", "1"], "the following arguments are required: --image"),
    ):
        status, out, err = launch(capsys, *argv)
        assert (status, out) == (2, "") and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert main(["launch", "kubernetes", "x"]) == 2
    assert capsys.readouterr().err == ("error: loongforge launch: unknown scheduler 'kubernetes'; known: slurm, k8s\n")


def test_the_installed_command_prints_yaml_and_one_line_errors():
    command = [sys.executable, "-m", "loongforge.cli", "launch", "k8s", str(QUICKSTART), "--nodes", "2",
               "--gpus-per-node", "8", "--image", "img:1", "--checkpoint-pvc", "ck", "--kind", "pytorchjob"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == ""
    assert [d["kind"] for d in yaml.safe_load_all(done.stdout)] == ["ConfigMap", "PyTorchJob"]
    failed = subprocess.run([*command, "--gpus-per-node", "eight"], capture_output=True, text=True)
    assert failed.returncode == 2 and failed.stdout == "" and failed.stderr.count("\n") == 1, failed.stderr
