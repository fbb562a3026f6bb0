"""Benchmarks (not tests): run through `make bench...`."""
