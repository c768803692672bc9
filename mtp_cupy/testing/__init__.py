"""Library code for tests and benchmarks: tiny checkpoint writers (testing.tiny) and torch peers."""
