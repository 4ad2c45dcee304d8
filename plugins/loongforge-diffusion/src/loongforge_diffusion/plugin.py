"""Entry point of the ``diffusion`` plugin: registers the Wan video DiT and Qwen-Image MMDiT flavors and the
plugin's commands (``loongforge sample``, ``loongforge cache-latents``, ``loongforge make-data moving-squares``;
see :mod:`loongforge_diffusion.commands`).

Torch-free at import and while registering: flavors are plain dataclasses; the torch model is built only when a
run asks for one (:func:`loongforge_diffusion.task.DiffusionTask.build_model`).
"""

from __future__ import annotations

from loongforge import hookimpl


@hookimpl
def loongforge_register_models(registry):
    from loongforge_diffusion.qwen_image import flavors as qwen_image
    from loongforge_diffusion.wan import flavors as wan

    for family in (wan, qwen_image):
        for name, flavor in family.FLAVORS.items():
            registry.register(name, flavor, aliases=family.HF_IDS.get(name, ()), description=family.describe(flavor))


@hookimpl
def loongforge_register_commands(commands):
    commands.add("sample", help="sample videos/images from a diffusion checkpoint",
                 configure="loongforge_diffusion.commands:configure_sample",
                 run="loongforge_diffusion.commands:run_sample")
    commands.add("cache-latents", help="encode captioned videos into a cache of Wan VAE latents and text states",
                 configure="loongforge_diffusion.commands:configure_cache_latents",
                 run="loongforge_diffusion.commands:run_cache_latents")
    commands.add_handler("convert mcore-to-hf", "dit-to-diffusers", claims="loongforge_diffusion.export:"
                         "claims_dit_checkpoint",
                         accepts="a LoongForge checkpoint of a Wan or Qwen-Image DiT (written as a diffusers "
                                 "transformer folder)",
                         configure="loongforge_diffusion.export:configure", run="loongforge_diffusion.export:run")
    commands.add_generator("moving-squares", help="write a moving-squares video dataset to a .pt file",
                           configure="loongforge_diffusion.commands:configure_moving_squares",
                           run="loongforge_diffusion.commands:run_moving_squares")


@hookimpl
def loongforge_register_certification_recipes(registry):
    registry.register("diffusion", "loongforge_diffusion.certification:IMAGE_DIT",
                      description="image DiT (qwen-image-tiny) with flow matching")
