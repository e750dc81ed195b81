"""Planning: what a step needs besides the kernel — resolved index lists, per-row metadata
refreshed in place, the step's tables, and a bounded cache of plans keyed by step shape
(docs/semantics.md §5)."""

from msa.planning.cache import PlanCache
from msa.planning.indices import resolve_entries
from msa.planning.refresh import RowMetadata
from msa.planning.tables import StepTables, tensor_versions

__all__ = ["PlanCache", "RowMetadata", "StepTables", "resolve_entries", "tensor_versions"]
