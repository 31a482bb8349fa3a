"""Benchmarks and the load tester (`bench.loadtest`, run as `pdserve loadtest`)."""
