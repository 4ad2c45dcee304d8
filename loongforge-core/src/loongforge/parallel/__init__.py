"""Parallel strategies: how a model is split over processes (megatron-core's layouts for LLMs)."""
