"""FAKE torch_xmlir -- NOT Kunlun's package.

Stands in for the module name of Kunlun's XPyTorch (``import torch_xmlir``, as in FlagOpen/FlagPerf's
``training/kunlunxin`` scripts; installed by the XPyTorch ``.run`` installer described in baidu-baige/LoongForge
``docs/source/kunlun_tutorial/install_p800.md``). The real import routes ``torch.cuda`` and ``nccl`` to the
XPU and BKCL; this fake only exists, so tests can check detection and that probing does not import it.
"""

__version__ = "0.0.0+fake"
