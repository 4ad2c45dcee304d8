"""Test support for LoongForge and its plugin authors.

Installed as a pytest plugin (entry point ``pytest11``), so its fixtures are available in any project
that has loongforge-core installed: ``plugin_host`` and ``register_plugin``. Conformance suites are
imported explicitly: :class:`loongforge.testing.device_suite.DeviceBackendSuite` for device backends (see
``examples/loongforge-example-device``), :class:`loongforge.testing.family_suite.ModelFamilySuite` for model
families (see ``examples/loongforge-example-family``); :mod:`loongforge.testing.discovery` checks that an
installed plugin is listed by ``loongforge plugins``.
"""
