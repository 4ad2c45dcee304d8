"""``loongforge diff RUN_A RUN_B``: where two runs, checkpoints or Hugging Face directories part.

Two training runs are compared step by step from their metrics (the first step whose loss or gradient norm parts);
two models -- a run's newest checkpoint, a checkpoint, a Hugging Face directory, in any layout they were saved at --
are built at TP=PP=1 and replay one batch with a hook on every module (:mod:`.trace`), and the first parameter,
forward output and gradient that differ beyond the tolerance are named, in the order the forward pass reaches them
(:mod:`.compare`). Nothing is hooked unless the command runs: training pays nothing for it.
"""
