"""The action parser fuzzed with Hypothesis (seconds, more than the unit folder's 2 s). The rest
of the forms family without a browser: tests/unit/envs/test_forms.py."""

from __future__ import annotations

import pytest

from flowrl_ray.envs.forms import parse_actions


def test_parser_fuzz_hypothesis():
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    @hypothesis.settings(max_examples=1500, deadline=None, derandomize=True)
    @hypothesis.given(st.text(alphabet=st.characters(), max_size=300)
                      | st.lists(st.sampled_from(['fill', 'click', '"', "'", "\\", " ", "\n", "x", "Submit"]))
                      .map("".join))
    def never_raises(text):
        parse_actions(text)

    never_raises()
