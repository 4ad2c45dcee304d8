"""Test support for LoongForge and its plugin authors.

Installed as a pytest plugin (entry point ``pytest11``), so its fixtures are available in any project
that has loongforge-core installed: ``plugin_host`` and ``register_plugin``.
"""
