from typing import Any

constexpr = Any

def __getattr__(name: str) -> Any: ...
