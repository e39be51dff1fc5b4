"""Stub: kv_events.py (SGLang >= 0.5.21) uses get_parallel only in is_kv_publisher_rank."""
from types import SimpleNamespace


def get_parallel():
    return SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0)
