"""Preference optimisation (``training.phase: dpo``): DPO, IPO, hinge (SLiC) and SimPO on chosen/rejected pairs.

- :mod:`.losses`: the losses and implicit rewards from sequence log-probs (plain torch);
- :mod:`.settings`: the ``dpo:`` section resolved and checked (torch-free, for ``loongforge check``);
- :mod:`.objective`: a micro-batch of pairs -> the loss megatron's schedule backpropagates, and the step's metrics;
- :mod:`.reference`: where the reference log-probs come from (a frozen copy, the policy with its LoRA adapters off,
  none, or a table computed before the first step);
- :mod:`.engine`: the megatron step engine that runs the reference pass and pairs the two.

Kept import-free so that the pre-flight reads :mod:`.settings` without torch.
"""
