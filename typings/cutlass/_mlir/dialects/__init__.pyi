from typing import Any

llvm: Any
