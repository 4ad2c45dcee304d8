"""Evaluating trained language models: lm-evaluation-harness tasks and held-out perplexity (``loongforge eval``)."""
