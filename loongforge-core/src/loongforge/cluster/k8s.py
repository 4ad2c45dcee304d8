"""``loongforge launch k8s CONFIG``: Kubernetes manifests for multi-node training, printed as one YAML stream.

The stream holds a ConfigMap with the config file as written (its comments survive; ``KEY=VALUE`` overrides go on
the command line, where ``kubectl get -o yaml`` shows them) and one workload of ``--kind``:

* ``jobset`` (default, ``jobset.x-k8s.io/v1alpha2``): one Job of N indexed pods. JobSet gives every pod a stable DNS
  name, ``<name>-node-0-<i>.<name>``, through its headless service, so the rendezvous address is known before any
  pod exists.
* ``pytorchjob`` (Kubeflow Training Operator, ``kubeflow.org/v1``): a Master and N-1 Workers; the operator's
  per-replica service names the master ``<name>-master-0``.
* ``trainjob`` (Kubeflow Trainer v2, ``trainer.kubeflow.org/v1alpha1``): runs on the ``torch-distributed``
  ClusterTrainingRuntime, whose JobSet is named after the TrainJob with a replicated job ``node``; the volumes and
  the grace period go in as a runtime patch.

Every pod runs the same torchrun a person would type on each machine (docs/parallelism.md): c10d rendezvous on
the first pod, ``--nproc-per-node G``, ``--max-restarts R`` for crashed ranks, then ``loongforge train`` with
``checkpoint.resume=auto`` and ``run.output_dir`` on the shared volume, so a restarted, rescheduled or preempted
pod group continues from the newest checkpoint that verifies. torchrun runs under :mod:`loongforge.cluster.agent`
(``python3 -m loongforge.cluster.agent`` + torchrun's own arguments), which makes the pod's exit status say what its
ranks did: 2 for an error to fix, which the failure policies never restart (JobSet: a pod failure rule on exit code
2 and a JobSet rule that fails the whole set on it; PyTorchJob: ``restartPolicy: ExitCode``, which retries only
statuses above 127, those the agent gives a crash, a hang or a preemption). A TrainJob's restarts are its runtime's
JobSet's; add the same two rules there.

Every pod requests CPU and memory (``--cpu`` / ``--memory``, by default from the config: ``training.threads`` CPUs
per rank -- :data:`DEFAULT_CPUS_PER_RANK` when unset -- and :data:`DEFAULT_MEMORY_PER_RANK_GI` GiB per rank), so the
scheduler places it where those are free and it is not the first pod evicted under memory pressure (a pod without
requests is ``BestEffort``). Nothing limits them: a limit would throttle the data loaders or kill a rank that
briefly needs more (an asynchronous save copies its share of the state into memory).

The preemption options (pass SIGUSR1 on as well as SIGTERM, wait ``--shutdown-timeout`` for the save) are given as
torchrun's ``PET_*`` environment variables rather than flags: a torch older than those flags (Kunlun's XPyTorch)
ignores unknown variables, where it would refuse an unknown flag. ``terminationGracePeriodSeconds`` leaves that save
time before the kubelet kills the pod.

Nothing here talks to a cluster. The config is validated the way ``train`` validates it (the loader, the layout for
N x G ranks) before anything is printed, so a mistake is one ``error:`` line here rather than a crash-looping pod.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from loongforge.cluster.layout import check_layout
from loongforge.config import load_config
from loongforge.errors import ConfigError

#: Where each pod mounts the checkpoint/output volume; a run writes under ``<MOUNT>/<name>``.
MOUNT = "/mnt/loongforge"
#: Where each pod mounts the ConfigMap; the config file is ``<CONFIG_DIR>/config.yaml``.
CONFIG_DIR = "/etc/loongforge"
#: The c10d rendezvous port on the first pod.
RDZV_PORT = 29500
#: Signals torchrun passes on to its ranks: its defaults plus Slurm's and some schedulers' pre-emption warning.
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
#: Seconds of the grace period kept back from torchrun's shutdown timeout, for it to report and exit.
SHUTDOWN_MARGIN = 30
#: The Kubeflow Trainer runtime a TrainJob runs on.
TRAINJOB_RUNTIME = "torch-distributed"
#: The replicated job of the JobSet (ours, and the one that runtime makes) and the TrainJob's trainer container.
NODE = "node"
#: CPUs requested per rank when ``training.threads`` is unset (one for the rank, the rest for its data and I/O).
DEFAULT_CPUS_PER_RANK = 4
#: Memory requested per rank, in GiB: a process with torch and its libraries, its batches and, with
#: ``checkpoint.async_save``, a host copy of its share of the state. Pass ``--memory`` for more.
DEFAULT_MEMORY_PER_RANK_GI = 16
#: ``loongforge``'s exit status for an error to fix (:mod:`loongforge.cluster.agent` passes it on): never restarted.
ERROR_TO_FIX = 2
#: What each pod runs: torchrun under the agent that turns the ranks' statuses into the pod's.
AGENT = ["python3", "-m", "loongforge.cluster.agent"]
#: ConfigMap data is limited to 1 MiB by the API server.
CONFIGMAP_LIMIT = 1 << 20
#: Longest ``--name``: JobSet pod names are ``<name>-node-<job>-<pod>-<5 random>`` and must stay DNS labels (63).
NAME_LIMIT = 40

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$", re.IGNORECASE)


@dataclass(frozen=True)
class Launch:
    """What the manifests are made from, every value already checked."""

    kind: str
    name: str
    namespace: str | None
    image: str
    nodes: int
    gpus_per_node: int
    accelerator: str  #: the extended resource the device plugin advertises (``nvidia.com/gpu``)
    cpu: str | None
    memory: str | None
    pvc: str | None
    max_restarts: int
    grace_seconds: int
    config_text: str
    train_args: tuple[str, ...]  #: ``loongforge train`` arguments: the mounted config, then the overrides


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Prints YAML for kubectl apply -f -. With --nodes > 1 the checkpoint volume must be shared: "
                     "every node writes its shards into the same checkpoint directory. See docs/cluster.md.")
    parser.add_argument("config", help="path to the run's YAML config (sent to the pods in a ConfigMap)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. training.steps=50")
    parser.add_argument("--nodes", type=int, required=True, metavar="N", help="pods, one per node")
    parser.add_argument("--gpus-per-node", type=int, required=True, metavar="G",
                        help="accelerators per pod: G ranks per pod and a limit of G on --accelerator-resource")
    parser.add_argument("--image", required=True, help="container image with LoongForge installed (containers/)")
    parser.add_argument("--kind", choices=("jobset", "pytorchjob", "trainjob"), default="jobset",
                        help="workload API: JobSet (default), Kubeflow PyTorchJob, or Kubeflow Trainer v2 TrainJob")
    parser.add_argument("--name", help="workload name, a DNS label (default: run.name); outputs go to "
                                       f"{MOUNT}/NAME")
    parser.add_argument("--namespace", help="namespace of every object (default: kubectl's current one)")
    parser.add_argument("--cpu", help="CPU request per pod, e.g. 32 or 500m (default: training.threads, or "
                                      f"{DEFAULT_CPUS_PER_RANK} when unset, per rank)")
    parser.add_argument("--memory", help=f"memory request per pod, e.g. 256Gi (default: "
                                         f"{DEFAULT_MEMORY_PER_RANK_GI}Gi per rank)")
    parser.add_argument("--checkpoint-pvc", metavar="CLAIM",
                        help=f"PersistentVolumeClaim mounted at {MOUNT} for checkpoints and outputs (ReadWriteMany "
                             "when --nodes > 1); without it (one node only) an emptyDir that dies with the pod")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="R",
                        help="torchrun restarts of crashed ranks, and restarts of the whole pod group (default 3)")
    parser.add_argument("--grace-period", type=int, default=300, metavar="SECONDS",
                        help="terminationGracePeriodSeconds: time for the preemption save after SIGTERM (default "
                             f"300; torchrun waits {SHUTDOWN_MARGIN} s less for its ranks)")
    parser.add_argument("--accelerator-resource", default="nvidia.com/gpu", metavar="RESOURCE",
                        help="extended resource of the accelerators (default nvidia.com/gpu; on Kunlun hosts the "
                             "name the XPU device plugin advertises)")


def run(args: argparse.Namespace) -> int:
    launch = launch_from(args)
    if launch.pvc is None:
        print(f"warning: no --checkpoint-pvc: checkpoints go to an emptyDir at {MOUNT} and are lost with the pod, "
              "so a rescheduled pod starts over", file=sys.stderr)
    sys.stdout.write(render(manifests(launch)))
    return 0


def launch_from(args: argparse.Namespace) -> Launch:
    """Check the flags and the config (as ``train`` would check it on N x G ranks); one ``ConfigError`` if not."""
    for flag, value, least in (("--nodes", args.nodes, 1), ("--gpus-per-node", args.gpus_per_node, 1),
                               ("--max-restarts", args.max_restarts, 0),
                               ("--grace-period", args.grace_period, 2 * SHUTDOWN_MARGIN)):
        if value < least:
            raise ConfigError(f"{flag} must be >= {least}, got {value}")
    for flag, value in (("--cpu", args.cpu), ("--memory", args.memory)):
        if value is not None and not _QUANTITY.match(value):
            raise ConfigError(f"{flag} {value!r} is not a Kubernetes quantity (e.g. 32, 500m, 256Gi)")
    _check_name("--namespace", args.namespace, _DNS_LABEL, 63)
    _check_name("--checkpoint-pvc", args.checkpoint_pvc, _DNS_SUBDOMAIN, 253)
    if not _RESOURCE.match(args.accelerator_resource):
        raise ConfigError(f"--accelerator-resource {args.accelerator_resource!r} is not a resource name like "
                          "nvidia.com/gpu")
    if not args.image or any(c.isspace() for c in args.image):
        raise ConfigError(f"--image {args.image!r} is not an image reference")
    if args.nodes > 1 and args.checkpoint_pvc is None:
        raise ConfigError(f"--nodes {args.nodes} needs --checkpoint-pvc: every node writes its shards of a checkpoint "
                          "into the same directory, which must be one shared (ReadWriteMany) volume")
    for item in args.overrides:
        if item.split("=", 1)[0].strip() == "run.output_dir":
            raise ConfigError(f"override {item!r}: launch k8s sets run.output_dir to {MOUNT}/NAME on the checkpoint "
                              "volume; choose the directory with --name")

    user = load_config(args.config, args.overrides)
    if args.name is not None:
        _check_name("--name", args.name, _DNS_LABEL, NAME_LIMIT)
    elif not _DNS_LABEL.match(_default_name(user.run.name)):
        raise ConfigError(f"{user.source}: run.name {user.run.name!r} makes no Kubernetes name; pass --name")
    name = args.name or _default_name(user.run.name)
    overrides = (*args.overrides, "checkpoint.resume=auto", f"run.output_dir={MOUNT}/{name}")
    config = load_config(args.config, overrides)
    _check_on_volume(config.checkpoint.dir, config.source)
    check_layout(config, args.nodes * args.gpus_per_node)
    text = Path(args.config).read_text(encoding="utf-8")
    if len(text.encode("utf-8")) > CONFIGMAP_LIMIT:
        raise ConfigError(f"{args.config}: larger than a ConfigMap holds (1 MiB)")
    cpu, memory = default_requests(config, args.gpus_per_node)
    return Launch(kind=args.kind, name=name, namespace=args.namespace, image=args.image, nodes=args.nodes,
                  gpus_per_node=args.gpus_per_node, accelerator=args.accelerator_resource, cpu=args.cpu or cpu,
                  memory=args.memory or memory, pvc=args.checkpoint_pvc, max_restarts=args.max_restarts,
                  grace_seconds=args.grace_period, config_text=text,
                  train_args=(f"{CONFIG_DIR}/config.yaml", *overrides))


def default_requests(config: Any, ranks: int) -> tuple[str, str]:
    """The CPU and memory a pod of ``ranks`` ranks requests unless ``--cpu`` / ``--memory`` say otherwise."""
    threads = config.training.threads or DEFAULT_CPUS_PER_RANK
    return str(ranks * threads), f"{ranks * DEFAULT_MEMORY_PER_RANK_GI}Gi"


def _check_name(flag: str, value: str | None, pattern: re.Pattern[str], limit: int) -> None:
    if value is not None and (len(value) > limit or not pattern.match(value)):
        raise ConfigError(f"{flag} {value!r} must be a lower-case DNS name of at most {limit} characters "
                          "(letters, digits, '-')")


def _default_name(run_name: str) -> str:
    """``run.name`` as a DNS label: lower case, other characters as ``-``, cut to :data:`NAME_LIMIT`."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).lstrip("-0123456789")
    return name[:NAME_LIMIT].rstrip("-")


def _check_on_volume(checkpoint_dir: str | None, source: str) -> None:
    """A checkpoint directory off the volume would be lost with its pod, and restarts would start over."""
    if checkpoint_dir is not None and not PurePosixPath(checkpoint_dir).is_relative_to(MOUNT):
        raise ConfigError(f"{source}: checkpoint.dir {checkpoint_dir!r} is not on the checkpoint volume mounted at "
                          f"{MOUNT}; leave it unset (it follows run.output_dir) or put it under {MOUNT}")



def manifests(launch: Launch) -> list[dict[str, Any]]:
    """The ConfigMap, then the workload of ``launch.kind``."""
    workload = {"jobset": jobset, "pytorchjob": pytorchjob, "trainjob": trainjob}[launch.kind]
    return [config_map(launch), workload(launch)]


def render(documents: list[dict[str, Any]]) -> str:
    return yaml.dump_all(documents, Dumper=_BlockStrings, sort_keys=False, default_flow_style=False, width=120)


class _BlockStrings(yaml.SafeDumper):
    """``safe_dump`` that writes multi-line strings (the config file) as ``|`` blocks, readable in the manifest, and
    repeats a shared value (the PyTorchJob's one pod template) instead of writing an anchor and an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_BlockStrings.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def _labels(launch: Launch) -> dict[str, str]:
    return {"app.kubernetes.io/name": "loongforge", "app.kubernetes.io/instance": launch.name}


def _metadata(launch: Launch, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if launch.namespace is not None:
        meta["namespace"] = launch.namespace
    meta["labels"] = _labels(launch)
    return meta


def config_map(launch: Launch) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(launch, f"{launch.name}-config"),
            "data": {"config.yaml": launch.config_text}}


def rendezvous_host(launch: Launch) -> str:
    """The first pod's DNS name, which hosts torchrun's c10d store: the operator's service of the PyTorchJob master,
    or pod 0 of job 0 under the JobSet's headless service (named after the JobSet, which a TrainJob's is too)."""
    if launch.kind == "pytorchjob":
        return f"{launch.name}-master-0"
    return f"{launch.name}-{NODE}-0-0.{launch.name}"


def torchrun_args(launch: Launch) -> list[str]:
    """Everything after ``torchrun``: the same on every pod."""
    return [f"--nnodes={launch.nodes}", f"--nproc-per-node={launch.gpus_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous_host(launch)}:{RDZV_PORT}", f"--rdzv-id={launch.name}",
            f"--max-restarts={launch.max_restarts}", "--module", "loongforge.cli", "train", *launch.train_args]


def _env(launch: Launch) -> list[dict[str, str]]:
    values = {
        "PYTHONUNBUFFERED": "1",
        # each restart attempt gets a fresh rendezvous store on every node (docs/reliability.md, elastic restarts)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PET_SIGNALS_TO_HANDLE": SIGNALS,
        "PET_SHUTDOWN_TIMEOUT": str(launch.grace_seconds - SHUTDOWN_MARGIN),
    }
    return [{"name": key, "value": value} for key, value in values.items()]


def _resources(launch: Launch) -> dict[str, Any]:
    resources: dict[str, Any] = {"limits": {launch.accelerator: launch.gpus_per_node}}
    requests = {key: value for key, value in (("cpu", launch.cpu), ("memory", launch.memory)) if value is not None}
    if requests:
        resources["requests"] = requests
    return resources


def _mounts() -> list[dict[str, Any]]:
    return [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "checkpoints", "mountPath": MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"}]  # the 64 MiB default is too small for NCCL and data workers


def _volumes(launch: Launch) -> list[dict[str, Any]]:
    storage = ({"persistentVolumeClaim": {"claimName": launch.pvc}} if launch.pvc is not None else {"emptyDir": {}})
    return [{"name": "config", "configMap": {"name": f"{launch.name}-config"}},
            {"name": "checkpoints", **storage},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}}]


def _container(launch: Launch, name: str, port_name: str) -> dict[str, Any]:
    return {"name": name, "image": launch.image, "command": list(AGENT), "args": torchrun_args(launch),
            "env": _env(launch), "ports": [{"name": port_name, "containerPort": RDZV_PORT}],
            "resources": _resources(launch), "volumeMounts": _mounts()}


def _pod_template(launch: Launch, container: dict[str, Any], restart_policy: str) -> dict[str, Any]:
    return {"metadata": {"labels": _labels(launch)},
            "spec": {"restartPolicy": restart_policy, "terminationGracePeriodSeconds": launch.grace_seconds,
                     "containers": [container], "volumes": _volumes(launch)}}


#: The Job controller's failure message for a pod that matched the exit-code rule (``Container C for pod P failed
#: with exit code 2 matching FailJob rule at index 1``), which the JobSet rule below matches.
ERROR_TO_FIX_MESSAGE = f"failed with exit code {ERROR_TO_FIX} matching FailJob rule"


def jobset(launch: Launch) -> dict[str, Any]:
    """One indexed Job of N pods. A failed pod fails its Job (``backoffLimit: 0``) and JobSet recreates every pod,
    up to ``--max-restarts`` times; a pod evicted or preempted (``DisruptionTarget``) restarts the group without
    using up a restart; a pod that exits 2 (an error to fix, :mod:`loongforge.cluster.agent`) fails the whole
    JobSet, which a restart would only repeat."""
    pod = _pod_template(launch, _container(launch, "trainer", "rendezvous"), "Never")
    rules = [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
             {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                   "values": [ERROR_TO_FIX]}}]
    job = {"parallelism": launch.nodes, "completions": launch.nodes, "completionMode": "Indexed", "backoffLimit": 0,
           "podFailurePolicy": {"rules": rules}, "template": pod}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _metadata(launch, launch.name),
            "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "failurePolicy": {"maxRestarts": launch.max_restarts,
                                       "rules": [{"name": "errors-to-fix-are-not-restarted", "action": "FailJobSet",
                                                  "onJobFailureReasons": ["PodFailurePolicy"],
                                                  "onJobFailureMessagePatterns": [ERROR_TO_FIX_MESSAGE]},
                                                 {"name": "preemption-restarts-for-free",
                                                  "action": "RestartJobSetAndIgnoreMaxRestarts",
                                                  "onJobFailureReasons": ["PodFailurePolicy"]}]},
                     "replicatedJobs": [{"name": NODE, "replicas": 1, "template": {"spec": job}}]}}


def pytorchjob(launch: Launch) -> dict[str, Any]:
    """A Master and N-1 Workers. ``restartPolicy: ExitCode`` has the operator recreate a pod that failed with a
    retryable status (above 127: the agent's crash, hang and preemption statuses; same name, so the rendezvous
    re-forms), at most ``--max-restarts`` times over the job (``runPolicy.backoffLimit``), and fail the job on any
    other (2: an error to fix). The operator's own ``MASTER_ADDR``/``PET_*`` variables are overridden by the explicit
    torchrun flags."""
    # The operator finds the trainer by these names: the container "pytorch", the master's port "pytorchjob-port".
    # Under ExitCode it restarts pods itself: the pods' own policy is Never.
    template = _pod_template(launch, _container(launch, "pytorch", "pytorchjob-port"), "Never")
    replicas = {"Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": template}}
    if launch.nodes > 1:
        replicas["Worker"] = {"replicas": launch.nodes - 1, "restartPolicy": "ExitCode", "template": template}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(launch, launch.name),
            "spec": {"nprocPerNode": str(launch.gpus_per_node),
                     "runPolicy": {"backoffLimit": launch.max_restarts, "cleanPodPolicy": "Running"},
                     "pytorchReplicaSpecs": replicas}}


def trainjob(launch: Launch) -> dict[str, Any]:
    """A TrainJob on the ``torch-distributed`` runtime. Its pods are restarted as that runtime's JobSet says
    (set ``failurePolicy`` there); torchrun's ``--max-restarts`` still restarts crashed ranks in place."""
    container = _container(launch, NODE, "rendezvous")
    pod_patch = {"terminationGracePeriodSeconds": launch.grace_seconds, "volumes": _volumes(launch),
                 "containers": [{"name": NODE, "volumeMounts": container["volumeMounts"]}]}
    patch = {"manager": "loongforge.launch",
             "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                 {"name": NODE, "template": {"spec": {"template": {"spec": pod_patch}}}}]}}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": _metadata(launch, launch.name),
            "spec": {"runtimeRef": {"name": TRAINJOB_RUNTIME},
                     "trainer": {"image": launch.image, "command": container["command"], "args": container["args"],
                                 "env": container["env"], "numNodes": launch.nodes,
                                 "numProcPerNode": launch.gpus_per_node, "resourcesPerNode": container["resources"]},
                     "runtimePatches": [patch]}}
