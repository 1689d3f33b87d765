"""When graphrt's vLLM plugin asks to be activated (docs/engines.md, "vLLM"): only when
``VLLM_PLUGINS`` names it, and only on the vLLM versions it was tested with. These are the plugin's
pure decisions, without vLLM; tests/engines/test_vllm.py runs them inside vLLM."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from graphrt.integrations import vllm as integration

names = st.text(st.characters(whitelist_categories=("Ll", "Nd"), whitelist_characters="_-"), min_size=1, max_size=8)


@given(st.lists(names, max_size=4), st.booleans())
def test_requested_only_when_vllm_plugins_names_graphrt(others, named):
    plugins = others + ([integration.PLUGIN_NAME] if named else [])
    assert integration.requested({"VLLM_PLUGINS": " , ".join(plugins)}) == (named or integration.PLUGIN_NAME in others)
    assert not integration.requested({})                  # unset: vLLM loads every plugin; graphrt stays out


@given(st.integers(0, 2), st.integers(0, 60), st.integers(0, 12), st.sampled_from(["", "+cpu", "rc1", ".dev3+gabc"]))
def test_versions_outside_the_tested_range_are_refused_naming_it(major, minor, patch, suffix):
    version = f"{major}.{minor}.{patch}{suffix}"
    problem = integration.version_problem(version)
    inside = integration.TESTED_FROM <= (major, minor, patch) < integration.TESTED_BELOW
    assert (problem is None) == inside
    if problem is not None:
        assert integration.TESTED_RANGE in problem and version in problem


def test_an_unparsable_version_is_refused():
    assert integration.TESTED_RANGE in integration.version_problem("dev")
