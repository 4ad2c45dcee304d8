"""One call order for every hook: tryfirst, then plain, then trylast; registration order inside each group.

``loongforge_modify_model`` is chained by the host, lifecycle hooks and ``firstresult`` hooks are called by it
too; this checks all of them run the same order, that core's own ``modify_model`` (weights, then LoRA) runs
before a plugin's plain one, and that wrapper implementations, which would escape the order, are refused.
"""

from __future__ import annotations

import pytest
from loongforge import hookimpl
from loongforge.config import LoongForgeConfig
from loongforge.errors import PluginLoadError
from loongforge.plugins import PluginHost


def _plugin(name: str, log: list[str], **opts: bool) -> object:
    """A plugin implementing a chained, a lifecycle and a firstresult hook, each logging ``name``."""

    class Plugin:
        @hookimpl(**opts)
        def loongforge_modify_model(self, model):
            log.append(f"modify:{name}")
            return [*model, name]

        @hookimpl(**opts)
        def loongforge_on_step_end(self, step):
            log.append(f"step:{name}")

        @hookimpl(**opts)
        def loongforge_balance_samples(self, samples):
            log.append(f"balance:{name}")
            return None if name != "last-plain" else [name]

    return Plugin()


#: Registration order, and the order LoongForge promises to call them in.
REGISTERED = (("plain", {}), ("late", {"trylast": True}), ("early", {"tryfirst": True}), ("last-plain", {}),
              ("earliest-registered-late", {"trylast": True}), ("second-early", {"tryfirst": True}))
CALLED = ["early", "second-early", "plain", "last-plain", "late", "earliest-registered-late"]


@pytest.fixture
def logged_host():
    log: list[str] = []
    host = PluginHost(autoload=False)
    for name, opts in REGISTERED:
        host.register(_plugin(name, log, **opts), name)
    return host, log


def test_chained_and_lifecycle_hooks_share_one_order(logged_host):
    host, log = logged_host
    assert host.modify_model([], LoongForgeConfig()) == CALLED  # each implementation saw the previous result
    host.on_step_end(trainer=None, step=1, metrics={})
    assert log == [f"modify:{n}" for n in CALLED] + [f"step:{n}" for n in CALLED]


def test_firstresult_stops_at_the_first_answer_in_that_order(logged_host):
    host, log = logged_host
    assert host.balance_samples(["sample"], dp_group=None) == ["last-plain"]
    assert log == [f"balance:{n}" for n in CALLED[: CALLED.index("last-plain") + 1]]


def test_unregistering_keeps_the_order_of_the_rest(logged_host):
    host, log = logged_host
    host.unregister("plain")
    host.register(_plugin("plain", log), "plain")  # registered again: now the last plain one
    assert host.modify_model([], LoongForgeConfig()) == ["early", "second-early", "last-plain", "plain", "late",
                                                          "earliest-registered-late"]


def test_core_loads_weights_before_a_plain_plugin_and_after_a_tryfirst_one(monkeypatch):
    import loongforge.interop.online as online

    log: list[str] = []
    monkeypatch.setattr(online, "load_initial_weights", lambda model, config: log.append("core:load-weights"))
    host = PluginHost()  # core (and the installed plugins) from entry points, then the in-process ones
    host.register(_plugin("wrapper", log), "wrapper")
    host.register(_plugin("before-core", log, tryfirst=True), "before-core")
    config = LoongForgeConfig()
    config.model.load = "hf:/nowhere"
    assert host.modify_model([], config) == ["before-core", "wrapper"]
    assert log == ["modify:before-core", "core:load-weights", "modify:wrapper"]


@pytest.mark.parametrize("style", ["wrapper", "hookwrapper"])
def test_wrapper_implementations_are_refused(style):
    class Wraps:
        @hookimpl(**{style: True})
        def loongforge_on_step_end(self, step):
            yield

    host = PluginHost(autoload=False)
    with pytest.raises(PluginLoadError, match=r"plugin 'wraps'.*is a wrapper; LoongForge calls hooks in one stated"):
        host.register(Wraps(), "wraps")
    assert "wraps" not in host.plugins and not host.implements("loongforge_on_step_end")
