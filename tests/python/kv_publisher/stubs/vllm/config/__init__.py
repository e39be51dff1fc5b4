"""Stub package for loading the engine's kv_events.py in isolation (test only)."""
