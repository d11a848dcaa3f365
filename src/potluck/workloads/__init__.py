"""Real training workloads for demos, examples and benchmarks (beyond the digits CNN)."""
