"""Megatron's multi-latent attention (MLA, DeepSeek-V2/V3) without Transformer Engine."""

from __future__ import annotations

#: megatron's MLA module, whose ``HAVE_TE`` flag is corrected.
MLA_MODULE = "megatron.core.transformer.multi_latent_attention"


def patch_mla_te_flag() -> bool:
    """Set ``multi_latent_attention.HAVE_TE`` to ``False`` when Transformer Engine is not really there.

    CUDA behaviour: the module imports ``TELinear``/``TEColumnParallelLinear`` from
    ``megatron.core.extensions.transformer_engine`` inside a ``try`` and sets ``HAVE_TE = True`` when the import
    succeeds. Without TE that import still succeeds: the extension module replaces ``transformer_engine`` by a
    ``MagicMock`` (and records its own ``HAVE_TE = False``), so ``TELinear`` is a mock instance, not a class.
    ``MultiLatentAttention.__init__`` then evaluates ``HAVE_TE and isinstance(self.linear_proj, TELinear)``, which
    raises "isinstance() arg 2 must be a type" on every machine without TE (every CPU machine). ``False`` is the
    value the module sets itself when the TE import fails, and its only use is that check.

    Patched only when the extension module reports TE missing or ``TELinear`` is not a class, so with TE really
    installed nothing changes. Returns whether the flag was changed by this call.
    """
    import importlib

    from megatron.core.extensions import transformer_engine as te_extension

    mla = importlib.import_module(MLA_MODULE)
    if not getattr(mla, "HAVE_TE", False):
        return False
    if te_extension.HAVE_TE and isinstance(getattr(mla, "TELinear", None), type):
        return False
    mla.HAVE_TE = False
    return True
