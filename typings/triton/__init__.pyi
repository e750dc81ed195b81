# Minimal stubs for the parts of triton msa uses (triton ships no type information).
from typing import Any, Callable, TypeVar

from . import language as language
from . import testing as testing

_F = TypeVar("_F", bound=Callable[..., Any])

__version__: str

def jit(fn: _F | None = ..., **kwargs: Any) -> Any: ...
def cdiv(x: int, y: int) -> int: ...
def next_power_of_2(n: int) -> int: ...
def __getattr__(name: str) -> Any: ...
