"""Benchmarks that print side-by-side comparison tables (`make bench`)."""
