"""The action tokenizer kinds by name.

The names live in a registry the embodied plugin owns (core's :class:`~loongforge.registry.Registry`, so an unknown
name is core's one line: the known names and a did-you-mean). Core has no hook for them: action tokens are this
plugin's vocabulary, which core never names. Targets are import paths (a
:class:`~loongforge_embodied.action_tokens.base.TokenizerKind` each), so this module is light enough for a command's
options and nothing loads until a kind is used.
"""

from __future__ import annotations

from loongforge.registry import Registry

ACTION_TOKENIZERS = Registry("action_tokenizer")
ACTION_TOKENIZERS.current_provider = "loongforge-embodied"
ACTION_TOKENIZERS.register("uniform-bins", "loongforge_embodied.action_tokens.binning:UNIFORM",
                           description="per-dimension equal-width bins over min..max or q01..q99 (RT-2 / OpenVLA)")
ACTION_TOKENIZERS.register("quantile-bins", "loongforge_embodied.action_tokens.binning:QUANTILE",
                           description="per-dimension bins with edges at the empirical quantiles")
ACTION_TOKENIZERS.register("fast", "loongforge_embodied.action_tokens.fast:FAST",
                           description="FAST: DCT of normalised chunks, scaled and rounded, then BPE")
ACTION_TOKENIZERS.current_provider = "<unknown>"
