"""Stub: NetworkAddress is used only by SGLang's port-planning helpers."""


class NetworkAddress:
    def __init__(self, host: str, port: int, is_ipv6: bool = False) -> None:
        self.host, self.port, self.is_ipv6 = host, port, is_ipv6

    @classmethod
    def parse(cls, text: str) -> "NetworkAddress":
        host, _, port = text.rpartition(":")
        return cls(host.strip("[]"), int(port), host.startswith("["))
