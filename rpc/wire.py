"""Every conversion between proto messages and the dataclasses they carry, in one place:
tiers, layouts, tier usage, node load, node descriptors and block selectors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES as _KEY_BYTES
from kvstore.keys import tokens_as_array
from kvstore.layout import KVLayout
from kvstore.tiers import Tier
from proto import common_pb2 as cpb
from proto import conductor_pb2 as pb

from .cluster import NodeDescriptor, NodeLoad, Role, TierUsage

if TYPE_CHECKING:  # the store itself (lmdb, pools) is not needed to convert its stats
    from kvstore.store import TierStats

# ---- tiers: proto numbers them from 1 (0 = unspecified) ----------------------------------------


_TIER_TO_PB = (cpb.TIER_GPU, cpb.TIER_DRAM, cpb.TIER_SSD)  # indexed by Tier


def tier_to_pb(tier: Tier | None) -> cpb.Tier:
    return cpb.TIER_UNSPECIFIED if tier is None else _TIER_TO_PB[tier]


def tier_from_pb(value: int) -> Tier:
    if not 1 <= value <= 3:
        raise InvalidArgument(f"tier {value} is not GPU, DRAM or SSD")
    return Tier(value - 1)


def tier_or_none_from_pb(value: int) -> Tier | None:
    """A reply's tier: None where the block is absent (TIER_UNSPECIFIED)."""
    return None if value == cpb.TIER_UNSPECIFIED else Tier(value - 1)


# Tier codes: one byte per block, the proto value (0: absent). Packed so that a reply about a
# thousand blocks carries one bytes field, not a thousand enum values to parse and wrap.
_TIER_OF_CODE: tuple[Tier | None, ...] = (None, Tier.GPU, Tier.DRAM, Tier.SSD)


def tier_codes(tiers: Sequence[Tier | None]) -> bytes:
    return bytes([0 if t is None else t + 1 for t in tiers])


def tiers_from_codes(codes: bytes) -> list[Tier | None]:
    if max(codes, default=0) > 3:
        raise InvalidArgument(f"tier code {max(codes)} is not GPU, DRAM or SSD")
    of = _TIER_OF_CODE
    return [of[c] for c in codes]


# ---- layouts ------------------------------------------------------------------------------------


def layout_to_pb(layout: KVLayout) -> cpb.Layout:
    return cpb.Layout(
        model=layout.model,
        num_layers=layout.num_layers,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        block_tokens=layout.block_tokens,
    )


def layout_from_pb(msg: cpb.Layout) -> KVLayout:
    return KVLayout(
        model=msg.model,
        num_layers=msg.num_layers,
        kv_heads=msg.kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype or "float16",
        block_tokens=msg.block_tokens or 256,
    )


# ---- tier usage and node load -------------------------------------------------------------------


def usage_of(stats: TierStats, page_bytes: int) -> TierUsage:
    """A store tier's stats as the usage a node reports."""
    return TierUsage(
        tier=Tier(stats.tier),
        capacity_pages=stats.capacity_pages,
        used_pages=stats.used_pages,
        free_pages=stats.free_pages,
        pinned_blocks=stats.pinned_blocks,
        page_bytes=page_bytes,
    )


def usage_to_pb(u: TierUsage) -> cpb.TierUsage:
    return cpb.TierUsage(
        tier=tier_to_pb(u.tier),
        capacity_pages=u.capacity_pages,
        used_pages=u.used_pages,
        free_pages=u.free_pages,
        pinned_blocks=u.pinned_blocks,
        page_bytes=u.page_bytes,
    )


def usage_from_pb(msg: cpb.TierUsage) -> TierUsage:
    return TierUsage(
        tier=tier_from_pb(msg.tier),
        capacity_pages=msg.capacity_pages,
        used_pages=msg.used_pages,
        free_pages=msg.free_pages,
        pinned_blocks=msg.pinned_blocks,
        page_bytes=msg.page_bytes,
    )


def load_to_pb(load: NodeLoad) -> cpb.NodeLoad:
    return cpb.NodeLoad(
        queued_prefill_tokens=load.queued_prefill_tokens,
        running_decode_requests=load.running_decode_requests,
        running_decode_tokens=load.running_decode_tokens,
        tiers=[usage_to_pb(u) for u in load.tiers],
    )


def load_from_pb(msg: cpb.NodeLoad) -> NodeLoad:
    return NodeLoad(
        queued_prefill_tokens=msg.queued_prefill_tokens,
        running_decode_requests=msg.running_decode_requests,
        running_decode_tokens=msg.running_decode_tokens,
        tiers=tuple(usage_from_pb(u) for u in msg.tiers),
    )


# ---- node descriptors ---------------------------------------------------------------------------

_ROLE_TO_PB = {
    Role.PREFILL: pb.NODE_ROLE_PREFILL,
    Role.DECODE: pb.NODE_ROLE_DECODE,
    Role.BOTH: pb.NODE_ROLE_BOTH,
}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}
_ROLE_FROM_PB[pb.NODE_ROLE_UNSPECIFIED] = Role.BOTH


def descriptor_to_pb(d: NodeDescriptor) -> pb.NodeDescriptor:
    return pb.NodeDescriptor(
        node_id=d.node_id,
        role=_ROLE_TO_PB[d.role],
        address=d.address,
        messenger_address=d.messenger_address,
        layouts=[layout_to_pb(x) for x in d.layouts],
        capacity=[usage_to_pb(u) for u in d.capacity],
    )


def descriptor_from_pb(msg: pb.NodeDescriptor) -> NodeDescriptor:
    role = _ROLE_FROM_PB.get(msg.role)
    if role is None:
        raise InvalidArgument(f"node.role {msg.role} is not PREFILL, DECODE or BOTH")
    return NodeDescriptor(
        node_id=msg.node_id,
        role=role,
        address=msg.address,
        messenger_address=msg.messenger_address,
        layouts=tuple(layout_from_pb(x) for x in msg.layouts),
        capacity=tuple(usage_from_pb(u) for u in msg.capacity),
    )


# ---- block selectors (the client side; servers resolve them with kvstore.keys.select_keys) -----


def selector_to_pb(
    namespace: str, keys: Sequence[bytes] | None = None, tokens: Any = None, salt: bytes | str = b""
) -> cpb.BlockSelector:
    """Blocks named by keys (sent packed, 16 bytes each) or by token ids (sent as packed
    little-endian uint32)."""
    if (keys is None) == (tokens is None):
        raise ValueError("give exactly one of keys= or tokens=")
    if isinstance(salt, str):
        salt = salt.encode()
    if tokens is not None:
        return cpb.BlockSelector(
            namespace=namespace, salt=salt, token_bytes=tokens_as_array(tokens).tobytes()
        )
    keys = keys or ()
    if all(map(_KEY_BYTES.__eq__, map(len, keys))):
        return cpb.BlockSelector(namespace=namespace, salt=salt, key_bytes=b"".join(keys))
    # A malformed key would shift every key after it in the packed form: send them one by one
    # and let the server say which key is wrong.
    return cpb.BlockSelector(namespace=namespace, salt=salt, keys=list(keys))
