"""Protobuf <-> domain conversion for the conductor, in one place."""
from __future__ import annotations

from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from kvstore.tiers import Tier
from proto import common_pb2 as cpb
from proto import conductor_pb2 as pb

from .registry import NodeDescriptor, NodeLoad, Role, TierUsage
from .scheduler import Decision, TransferPlan

_ROLE_TO_PB = {Role.PREFILL: pb.NODE_ROLE_PREFILL, Role.DECODE: pb.NODE_ROLE_DECODE,
               Role.BOTH: pb.NODE_ROLE_BOTH}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}
_ROLE_FROM_PB[pb.NODE_ROLE_UNSPECIFIED] = Role.BOTH


def tier_from_pb(value: int) -> Tier:
    if not 1 <= value <= 3:
        raise InvalidArgument(f"tier {value} is not GPU, DRAM or SSD")
    return Tier(value - 1)


def layout_to_pb(layout: KVLayout) -> cpb.Layout:
    return cpb.Layout(model=layout.model, num_layers=layout.num_layers, kv_heads=layout.kv_heads,
                      head_dim=layout.head_dim, dtype=layout.dtype,
                      block_tokens=layout.block_tokens)


def layout_from_pb(msg: cpb.Layout) -> KVLayout:
    return KVLayout(model=msg.model, num_layers=msg.num_layers, kv_heads=msg.kv_heads,
                    head_dim=msg.head_dim, dtype=msg.dtype or "float16",
                    block_tokens=msg.block_tokens or 256)


def usage_to_pb(u: TierUsage) -> cpb.TierUsage:
    return cpb.TierUsage(tier=int(u.tier) + 1, capacity_pages=u.capacity_pages,
                         used_pages=u.used_pages, free_pages=u.free_pages,
                         pinned_blocks=u.pinned_blocks, page_bytes=u.page_bytes)


def usage_from_pb(msg: cpb.TierUsage) -> TierUsage:
    return TierUsage(tier=tier_from_pb(msg.tier), capacity_pages=msg.capacity_pages,
                     used_pages=msg.used_pages, free_pages=msg.free_pages,
                     pinned_blocks=msg.pinned_blocks, page_bytes=msg.page_bytes)


def load_to_pb(load: NodeLoad) -> cpb.NodeLoad:
    return cpb.NodeLoad(queued_prefill_tokens=load.queued_prefill_tokens,
                        running_decode_requests=load.running_decode_requests,
                        running_decode_tokens=load.running_decode_tokens,
                        tiers=[usage_to_pb(u) for u in load.tiers])


def load_from_pb(msg: cpb.NodeLoad) -> NodeLoad:
    return NodeLoad(queued_prefill_tokens=msg.queued_prefill_tokens,
                    running_decode_requests=msg.running_decode_requests,
                    running_decode_tokens=msg.running_decode_tokens,
                    tiers=tuple(usage_from_pb(u) for u in msg.tiers))


def descriptor_to_pb(d: NodeDescriptor) -> pb.NodeDescriptor:
    return pb.NodeDescriptor(node_id=d.node_id, role=_ROLE_TO_PB[d.role], address=d.address,
                             messenger_address=d.messenger_address,
                             layouts=[layout_to_pb(l) for l in d.layouts],
                             capacity=[usage_to_pb(u) for u in d.capacity])


def descriptor_from_pb(msg: pb.NodeDescriptor) -> NodeDescriptor:
    role = _ROLE_FROM_PB.get(msg.role)
    if role is None:
        raise InvalidArgument(f"node.role {msg.role} is not PREFILL, DECODE or BOTH")
    return NodeDescriptor(node_id=msg.node_id, role=role, address=msg.address,
                          messenger_address=msg.messenger_address,
                          layouts=tuple(layout_from_pb(l) for l in msg.layouts),
                          capacity=tuple(usage_from_pb(u) for u in msg.capacity))


def plan_to_pb(plan: TransferPlan) -> pb.TransferPlan:
    return pb.TransferPlan(src_node=plan.src.node_id, src_address=plan.src.address,
                           src_messenger=plan.src.messenger_address, dst_node=plan.dst.node_id,
                           dst_address=plan.dst.address,
                           dst_messenger=plan.dst.messenger_address, namespace=plan.namespace,
                           keys=plan.keys, first_block=plan.first_block, bytes=plan.nbytes,
                           est_seconds=plan.est_seconds)


def decision_to_pb(d: Decision, request_id: str) -> pb.ScheduleReply:
    """``request_id``: the id as the caller named it (the decision's may carry a tenant scope)."""
    return pb.ScheduleReply(
        request_id=request_id, policy=d.policy, prefill_node=d.prefill.node_id,
        prefill_address=d.prefill.address, prefill_messenger=d.prefill.messenger_address,
        decode_node=d.decode.node_id, decode_address=d.decode.address,
        decode_messenger=d.decode.messenger_address, total_blocks=d.total_blocks,
        local_blocks=d.local_blocks, best_blocks=d.best_blocks, reuse_blocks=d.reuse_blocks,
        transfers=[plan_to_pb(d.transfer)] if d.transfer is not None else [],
        est_queue_s=d.est_queue_s, est_transfer_s=d.est_transfer_s,
        est_prefill_s=d.est_prefill_s, est_ttft_s=d.est_ttft_s, est_tbt_s=d.est_tbt_s)
