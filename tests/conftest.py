"""Shared pytest configuration for the jax_ops test suite."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "heavy: long rows (65536 columns); runs in CI with few rows, select with -m heavy")
