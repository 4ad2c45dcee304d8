"""The Qwen3-Next family: Gated DeltaNet linear attention interleaved with gated full attention, zero-centred
RMSNorm and mixture-of-experts MLPs with a gated shared expert, built through core's family seams as a plugin
would (``DecoderSpec`` layers from the device's spec provider, an ``HFReader`` under ``Qwen3NextForCausalLM``).

Modules, one job each: :mod:`.flavors` (the sizes, torch-free), :mod:`.deltanet` (the gated delta rule op and its
replaceable seam), :mod:`.mixer` (the Gated DeltaNet token mixer module), :mod:`.layers` (per-layer megatron specs),
:mod:`.hf` (``config.json`` reader and tensor adapter), :mod:`.registration` (what core's hooks call, torch-free).
Importing this package imports nothing heavy.
"""
