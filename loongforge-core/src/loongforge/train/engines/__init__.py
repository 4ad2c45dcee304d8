"""Step engines: what differs between training a megatron decoder and a task model, behind one interface
(:class:`~loongforge.train.engines.base.StepEngine`) that the one loop (:mod:`loongforge.train.loop`) drives."""
