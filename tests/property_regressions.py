"""Cases the property-based tests (test_properties.py) found failing, kept as regression cases:
each one is replayed by test_properties.test_regressions. Add a failing Case exactly as the test
printed it, with a comment naming what was wrong."""

from lmkernels.harness.properties import Case

REGRESSIONS: list[Case] = []
