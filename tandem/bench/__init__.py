"""Benchmarks: `tandem bench throughput | structured | spec | serve`. Commands, not tests."""
