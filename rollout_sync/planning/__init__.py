"""Pure planning: from source and target maps to a deterministic plan of point-to-point copies."""

from .half import PlanHalf
from .plan import Plan
from .planner import plan_model, plan_tensor
from .policy import Balanced, ReplicaPolicy, ReplicaRequest, lowest
from .records import PlannedTensor, Segment

__all__ = [
    "Balanced",
    "Plan",
    "PlanHalf",
    "PlannedTensor",
    "ReplicaPolicy",
    "ReplicaRequest",
    "Segment",
    "lowest",
    "plan_model",
    "plan_tensor",
]
