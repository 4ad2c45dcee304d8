"""VLA policies trained by ``loongforge train`` (see :mod:`loongforge_embodied.train_task`).

- :mod:`~loongforge_embodied.policies.flavors`: ``Pi05Flavor`` / ``Pi0Flavor`` sizes by name (torch-free; what the
  plugin registers)
- :mod:`~loongforge_embodied.policies.blocks`: the layers Pi0 and Pi0.5 share (patch ViT, joint prefix/expert
  attention, block-causal mask, rotary positions, time embedding)
- :mod:`~loongforge_embodied.policies.pi05`: the Pi0.5-style policy (prefix transformer + action expert, plain torch)
- :mod:`~loongforge_embodied.policies.pi0`: the Pi0-style policy (continuous state token, action-time MLP)
- :mod:`~loongforge_embodied.policies.flow_matching`: Beta time, noisy chunks, the masked loss, Euler sampling
- :mod:`~loongforge_embodied.policies.prompt`: task text (and Pi0.5's discretised state) as prompt tokens
- :mod:`~loongforge_embodied.policies.reach`: a learnable synthetic LeRobot set (reach a square seen in the camera)
"""
