"""Reinforcement learning with verifiable rewards (``training.phase: grpo``): GRPO on prompts whose replies a reward
checks.

- :mod:`.rewards`: the reward contract and the built-in checks (torch-free);
- :mod:`.settings`: the ``grpo:`` section resolved and checked (torch-free, for ``loongforge check``);
- :mod:`.rollout`: sampling the replies with the trainer's own forward, so that every sampled token's log-prob is
  what the training step recomputes, bit for bit;
- :mod:`.objective`: group-normalised advantages and the clipped policy loss with its KL term and aggregation;
- :mod:`.routing_replay`: an MoE model's expert choices recorded at rollout and reused in the training forward;
- :mod:`.engine`: the megatron step engine that rolls out, scores, and updates.

Kept import-free so that the pre-flight reads :mod:`.settings` without torch.
"""
