"""The plugin's hook targets exist, with the signatures it expects, in the pinned SGLang."""

from importlib.metadata import entry_points

from sgl_vtoken.patches.core import contract
from sgl_vtoken.patches.plugin import HOOKS


def test_installed_sglang_matches_the_contract():
    assert contract.check_contract() == []


def test_the_plugin_hooks_exactly_the_contract_targets():
    """`check_hooks_applied` checks `HOOKED_PARAMS`: it must list every hooked target, and no other."""
    assert {t for t, _, _ in HOOKS} == set(contract.HOOKED_PARAMS)


def test_hooks_are_applied_after_plugins_load():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    assert contract.check_hooks_applied() == []


def test_contract_reports_a_renamed_parameter(monkeypatch):
    target = "sglang.srt.managers.scheduler.Scheduler.__init__"
    monkeypatch.setitem(contract.EXPECTED_PARAMS, target, ("self", "args", "port_args"))
    problems = contract.check_contract()
    assert len(problems) == 1 and target in problems[0]


def test_entry_point_is_registered():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "sgl_vtoken"]
    assert len(eps) == 1 and eps[0].value == "sgl_vtoken.patches:register"
