"""Wilson interval against values computed by hand."""

import pytest

from trace_lib.stats import wilson_interval


def test_wilson_known_values():
    lo, hi = wilson_interval(3, 28)
    assert lo == pytest.approx(0.03712, abs=1e-4)
    assert hi == pytest.approx(0.27196, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0)


def test_wilson_empty_sample_is_uninformative():
    assert wilson_interval(0, 0) == (0.0, 1.0)
