"""What a node tells the conductor about itself: its descriptor (id, role, addresses, layouts,
capacity) when it registers, and its load with every heartbeat. Shared by the node's agent, the
conductor and the wire conversions (``rpc.wire``)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, echo
from kvstore.layout import KVLayout
from kvstore.tiers import Tier

_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @classmethod
    def parse(cls, value: "str | Role") -> "Role":
        if isinstance(value, Role):
            return value
        try:
            return cls(value.lower())
        except ValueError:
            raise InvalidArgument(
                f"unknown node role {echo(value)}; use prefill, decode or both"
            ) from None

    @property
    def prefills(self) -> bool:
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL


@dataclass(frozen=True, kw_only=True)
class TierUsage:
    tier: Tier
    capacity_pages: int = 0
    used_pages: int = 0
    free_pages: int = 0
    pinned_blocks: int = 0
    page_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class NodeLoad:
    """What a heartbeat reports (proto ``NodeLoad``)."""

    queued_prefill_tokens: int = 0
    running_decode_requests: int = 0
    running_decode_tokens: int = 0
    tiers: tuple[TierUsage, ...] = ()


def check_node_id(node_id: str) -> None:
    """InvalidArgument unless ``node_id`` is a valid node id (what a node may register as)."""
    if not isinstance(node_id, str) or not _NODE_ID.match(node_id):
        raise InvalidArgument(
            f"node id {echo(node_id)} must be 1-128 characters of letters, digits and "
            "._:@- starting with a letter or digit"
        )


@dataclass(frozen=True, kw_only=True)
class NodeDescriptor:
    """What a node tells the conductor when it registers."""

    node_id: str
    role: Role = Role.BOTH
    address: str = ""  # its NodeService (gRPC); "" for simulated nodes
    messenger_address: str = ""  # its MessengerService (gRPC); "" when none
    layouts: tuple[KVLayout, ...] = ()
    capacity: tuple[TierUsage, ...] = ()

    def __post_init__(self) -> None:
        check_node_id(self.node_id)
        object.__setattr__(self, "role", Role.parse(self.role))

    @property
    def namespaces(self) -> frozenset[str]:
        return frozenset(layout.namespace for layout in self.layouts)

    def serves(self, namespace: str) -> bool:
        """True when the node serves ``namespace`` ("" matches every node)."""
        return not namespace or any(l.namespace == namespace for l in self.layouts)
