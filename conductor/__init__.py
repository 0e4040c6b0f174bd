"""The conductor: KV-cache-centric global scheduler (registry, global block index, scheduler).

In-process use (simulation, tests) needs no gRPC: ``GlobalIndex`` + ``Registry`` + ``Scheduler``
with a ``CostModel``. The gRPC service (``conductor.service``) wraps them in ``core.Conductor``.
"""

from .costmodel import (
    DEFAULT_COST_MODEL,
    CostModel,
    FittedCostModel,
    FlopsCostModel,
    HardwareSpec,
    ModelSpec,
    PrefillSample,
    fit_prefill,
)
from .index import GlobalIndex, SequenceGap
from .registry import NodeDescriptor, NodeLoad, NodeState, Registry, Role, TierUsage
from .scheduler import (
    POLICIES,
    Decision,
    NoNodeAvailable,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    SLORejected,
    TransferPlan,
    make_policy,
)

__all__ = [
    "CostModel",
    "DEFAULT_COST_MODEL",
    "Decision",
    "FittedCostModel",
    "FlopsCostModel",
    "GlobalIndex",
    "HardwareSpec",
    "ModelSpec",
    "NoNodeAvailable",
    "NodeDescriptor",
    "NodeLoad",
    "NodeState",
    "POLICIES",
    "PrefillSample",
    "Registry",
    "Request",
    "Role",
    "SLORejected",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SequenceGap",
    "TierUsage",
    "TransferPlan",
    "fit_prefill",
    "make_policy",
]
