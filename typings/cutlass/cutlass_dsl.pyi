from typing import Any

T: Any
