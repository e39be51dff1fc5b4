"""Stub used only when pydantic is not installed: SGLang's kv_events.py
subclasses BaseModel for its config class, which the test never builds."""


class BaseModel:
    pass
