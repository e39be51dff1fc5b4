"""Stub: only the ExternalBlockHash type alias is needed by kv_events.py."""

ExternalBlockHash = bytes | int
