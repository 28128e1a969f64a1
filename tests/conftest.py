"""Shared pytest configuration for the jax_ops test suite."""
import os

# Eight host devices for the multi-device tests (sharding, shard_map, axis_name
# statistics). Must be set before jax initializes its CPU backend; it changes nothing
# on a GPU backend, where the tests run on device 0 unless they ask for a mesh.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "heavy: long rows (65536 columns); runs in CI with few rows, select with -m heavy")
