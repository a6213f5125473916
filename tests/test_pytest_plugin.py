"""corelib's pytest plugin (entry point ``pytest11``): tests marked ``slow`` are collected
first, so that parallel workers start the long ones side by side."""

from __future__ import annotations

pytest_plugins = ["pytester"]


def test_slow_tests_are_collected_first_and_the_rest_keep_their_order(pytester):
    pytester.makepyfile(test_order="""
        import pytest

        def test_a():
            pass

        @pytest.mark.slow
        def test_long_one():
            pass

        def test_b():
            pass

        @pytest.mark.slow
        def test_long_two():
            pass
        """)
    result = pytester.runpytest("--collect-only", "-q")
    names = [line.split("::")[-1] for line in result.outlines if "::" in line]
    assert names == ["test_long_one", "test_long_two", "test_a", "test_b"]


def test_the_slow_marker_is_registered(pytester):
    pytester.makepyfile(test_marked="""
        import pytest

        @pytest.mark.slow
        def test_long():
            pass
        """)
    result = pytester.runpytest("--strict-markers", "-q")  # the entry point loads the plugin
    result.assert_outcomes(passed=1)
