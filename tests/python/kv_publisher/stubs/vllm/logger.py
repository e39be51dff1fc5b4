"""Stub: vLLM's logger factory, mapped onto the standard library."""

import logging


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
