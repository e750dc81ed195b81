from typing import Any

class SmemAllocator:
    def allocate_tensor(self, *args: Any, **kwargs: Any) -> Any: ...
