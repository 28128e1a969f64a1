"""Pallas GPU kernels (run with interpret=True on CPU). Populated by the dispatch issue."""
