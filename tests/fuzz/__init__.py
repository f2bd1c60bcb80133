"""Fuzzers run by the test suite (see plan_fuzz.py and tests/test_plan_fuzz.py)."""
