"""The policy families' pre-flight (``ModelFamily.check_task``): the data a policy run trains on, opened and held
to the flavor the way :class:`loongforge_embodied.train_task.PolicyTask` will, before ``check`` or ``train`` builds
anything.

Why more than the reader's checks: a LeRobot set that reads cleanly can still not train this flavor -- cameras it
does not have, states or actions wider than the flavor pads to, fewer training frames than one batch, no held-out
episode for an evaluation -- and each of those used to surface only after the model was built. Here the reader checks
the whole set (metadata, data files, columns, stats, every video opening) with the action horizon, the first
training frame is read as training reads it (its action chunk, its cameras decoded), and the training and held-out
frames are held to the batch. An RLDS mixture spec is read and written as its LeRobot set first (into the
run's ``output_dir/data``, where training then finds it). The synthetic reach set (``task.data: null``) is written
by the run itself, so only its known layout is held to the flavor.
Numpy, pyarrow and PyAV only: no torch, no model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.train.task_sizes import check_data_sizes


def check_policy_task(flavor: Any, config: Any, options: Any) -> list[str]:
    """One summary line for the policy task's data; a one-line error naming the file, episode or option when
    training could not use it."""
    if options.data is None:
        return _check_synthetic(flavor, config, options)
    from loongforge_embodied.data.lerobot_dataset import LeRobotDataset

    root = options.data_root(config.run.output_dir)  # an RLDS mixture spec is written as a LeRobot set here
    dataset = LeRobotDataset(root, action_horizon=options.action_horizon)
    opened, named = dataset.check_videos()
    train, held_out = options.split([ep.index for ep in dataset.episodes], root, config.source)
    options.camera_keys(flavor.cameras, dataset.camera_keys, root, config.source, dataset.info.depth_keys)
    first = dataset[0]  # episode 0 trains (the held-out ones are last): its action chunk and cameras decoded
    dataset.close()
    flavor.check_dims(first["observation.state"].shape[-1], first["action"].shape[-1], root)
    lengths = {ep.index: ep.length for ep in dataset.episodes}
    validation = None
    if config.evaluation.interval:
        validation = _validation(config, options, first, sum(lengths[i] for i in held_out))
    check_data_sizes(config, (sum(lengths[i] for i in train), f"{config.source}: task.data {root}"), validation)
    return [f"task.data: {dataset.describe()}; {opened} of {named} video file(s) opened"]


def _check_synthetic(flavor: Any, config: Any, options: Any) -> list[str]:
    """The synthetic reach set's layout (:mod:`loongforge_embodied.policies.reach`) held to the flavor and batch."""
    from loongforge_embodied.policies.reach import ACTION_DIM, CAMERA, STATE_DIM

    synthetic = options.synthetic
    name = "the synthetic set (task.synthetic)"
    train, held_out = options.split(list(range(synthetic.episodes)), name, config.source)
    options.camera_keys(flavor.cameras, [CAMERA], name, config.source)
    flavor.check_dims(STATE_DIM, ACTION_DIM, name)
    validation = None
    if config.evaluation.interval:
        options.validation_paths(list(config.evaluation.data), config.source)
        if not config.evaluation.data:
            validation = (len(held_out) * synthetic.length, "the held-out episodes")
    check_data_sizes(config, (len(train) * synthetic.length, f"{config.source}: {name}"), validation)
    return [f"task.data: {name}, {synthetic.episodes} episodes of {synthetic.length} frames, written by the run"]


def _validation(config: Any, options: Any, first: dict[str, Any], held_out_frames: int) -> tuple[int, str]:
    """What the evaluation reads: ``evaluation.data``'s one root (opened, its widths those of the training data) or
    the held-out episodes' frames; (frames, where) for the batch check."""
    from loongforge_embodied.data.lerobot_dataset import LeRobotDataset

    paths = options.validation_paths(list(config.evaluation.data), config.source)
    if not paths:
        return held_out_frames, "the held-out episodes"
    root = Path(paths[0]).expanduser()
    other = LeRobotDataset(root, action_horizon=options.action_horizon)
    sample = other[0]
    other.close()
    widths = (sample["observation.state"].shape[-1], sample["action"].shape[-1])
    trained = (first["observation.state"].shape[-1], first["action"].shape[-1])
    if widths != trained:
        from loongforge.errors import ConfigError

        raise ConfigError(f"{config.source}: evaluation.data {root} has state/action dimensions {widths}; the "
                          f"training data has {trained}")
    return len(other), f"evaluation.data ({root})"
