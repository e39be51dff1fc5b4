"""Helpers of the gateway end-to-end test (test_gateway.py): the real Envoy
binary, its configurations and a stub inference engine."""
