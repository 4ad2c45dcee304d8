"""Action tokenizers: continuous action chunks ``(H, D)`` as token ids a language-model policy can predict, and back.

Kinds, by name (:data:`~loongforge_embodied.action_tokens.names.ACTION_TOKENIZERS`):

- ``uniform-bins``: per-dimension equal-width bins between the fitted range (RT-2 / OpenVLA); one token per value;
- ``quantile-bins``: per-dimension bins with edges at the empirical quantiles (equal counts per bin);
- ``fast``: FAST -- per-chunk DCT of the normalised actions, scaled and rounded, then BPE over the coefficients
  (Hugging Face ``tokenizers``); a few tokens per smooth chunk.

Each is fitted on a dataset's chunks (:func:`fit_action_tokenizer`), states the largest round-trip error it can make
on actions inside its fitted range (``error_bound``), and saves as JSON (plus the BPE's own JSON) into a directory
a policy keeps beside its checkpoint (:func:`load_action_tokenizer`). Importing this package is free; numpy and
``tokenizers`` load with the submodules. Modules:

- :mod:`~loongforge_embodied.action_tokens.base`: the ``ActionTokenizer`` protocol, the saved layout, id fixing
- :mod:`~loongforge_embodied.action_tokens.binning` / :mod:`~loongforge_embodied.action_tokens.fast`: the kinds
- :mod:`~loongforge_embodied.action_tokens.names`: the kinds by name (a registry the plugin owns)
- :mod:`~loongforge_embodied.action_tokens.registry`: fit, load, the round-trip measurement
- :mod:`~loongforge_embodied.action_tokens.chunks`: action chunks of a LeRobotDataset
- :mod:`~loongforge_embodied.action_tokens.command`: ``loongforge fit-action-tokenizer``
"""

from __future__ import annotations

from loongforge.lazy import lazy_exports

_EXPORTS = {
    "ActionTokenizer": "base",
    "ACTION_TOKENIZERS": "names",
    "fit_action_tokenizer": "registry",
    "load_action_tokenizer": "registry",
    "measure_round_trip": "registry",
    "RoundTrip": "registry",
    "action_chunks": "chunks",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
