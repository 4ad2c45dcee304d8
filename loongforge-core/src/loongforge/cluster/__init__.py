"""Running LoongForge on cluster schedulers: ``loongforge launch slurm|k8s`` (:mod:`loongforge.cluster.command`).

Each scheduler is one module with ``configure(parser)`` and ``run(args) -> int``. They write what the scheduler
runs -- an sbatch script, Kubernetes manifests -- and every one of them starts the same thing on each node:
``torchrun`` with c10d rendezvous on the first node, ``checkpoint.resume=auto`` and the preemption signals passed on
to the ranks, so a killed, preempted or restarted job continues from its newest verified checkpoint.
"""
