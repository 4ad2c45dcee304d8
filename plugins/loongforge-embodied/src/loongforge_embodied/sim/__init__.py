"""Closed-loop simulation for VLA policies: Meta-World and LIBERO tasks (CALVIN and SimplerEnv adapters too), expert
data collection, a policy server and client, and success-rate evaluation (``pip install
"loongforge-embodied[sim,serve]"``; ``[libero]`` for LIBERO).

Importing this package is free (no MuJoCo, torch or websockets): the names below load on first use. Modules:

- :mod:`~loongforge_embodied.sim.environment`: ``make_env(name)``, the one interface every simulator is adapted to
  (``reach-v3``, ``libero:libero_object/0``, ``calvin:open_drawer``, ``simpler:widowx_carrot_on_plate``); adapters in
  ``libero_adapter``, ``calvin_adapter``, ``simpler_adapter``; LIBERO's scripted expert in ``libero_expert``
- :mod:`~loongforge_embodied.sim.metaworld_env`: ``MetaWorldEnv`` (episodes that are a function of a seed), task
  texts, Meta-World's scripted experts
- :mod:`~loongforge_embodied.sim.collect`: ``loongforge collect`` expert -> LeRobotDataset
- :mod:`~loongforge_embodied.sim.policy`: ``CheckpointPolicy`` (a trained checkpoint, in process), ``RandomPolicy``
- :mod:`~loongforge_embodied.sim.protocol`: the server's msgpack messages and array encoding
- :mod:`~loongforge_embodied.sim.server` / :mod:`~loongforge_embodied.sim.client`: ``loongforge serve
  CKPT`` and ``PolicyClient``
- :mod:`~loongforge_embodied.sim.evaluate`: ``loongforge eval CKPT`` success rate on
  unseen seeds, in process or through a server, with a ``summary.json``
- :mod:`~loongforge_embodied.sim.recording`: ``RolloutRecorder``, one MP4/GIF per evaluated episode (``--videos``)
"""

from __future__ import annotations

from loongforge.lazy import lazy_exports

_EXPORTS = {
    "make_env": "environment",
    "Observation": "environment",
    "SimEnvironment": "environment",
    "MetaWorldEnv": "metaworld_env",
    "task_text": "metaworld_env",
    "expert": "metaworld_env",
    "collect": "collect",
    "CheckpointPolicy": "policy",
    "RandomPolicy": "policy",
    "PolicyClient": "client",
    "PolicyServerError": "client",
    "make_server": "server",
    "evaluate": "evaluate",
    "RolloutRecorder": "recording",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
