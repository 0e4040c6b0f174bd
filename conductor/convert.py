"""Scheduling decisions as proto replies (node, tier and layout conversions: ``rpc.wire``)."""

from __future__ import annotations

from proto import conductor_pb2 as pb

from .scheduler import Decision


def decision_to_pb(d: Decision, request_id: str) -> pb.ScheduleReply:
    """``request_id``: the id as the caller named it (the decision's may carry a tenant scope)."""
    reply = pb.ScheduleReply(
        request_id=request_id,
        policy=d.policy,
        prefill_node=d.prefill.node_id,
        prefill_address=d.prefill.address,
        prefill_messenger=d.prefill.messenger_address,
        decode_node=d.decode.node_id,
        decode_address=d.decode.address,
        decode_messenger=d.decode.messenger_address,
        total_blocks=d.total_blocks,
        local_blocks=d.local_blocks,
        best_blocks=d.best_blocks,
        reuse_blocks=d.reuse_blocks,
        est_queue_s=d.est_queue_s,
        est_transfer_s=d.est_transfer_s,
        est_prefill_s=d.est_prefill_s,
        est_ttft_s=d.est_ttft_s,
        est_tbt_s=d.est_tbt_s,
    )
    plan = d.transfer
    if plan is not None:  # NOTE: built in place; a TransferPlan built apart is copied in
        reply.transfers.add(
            src_node=plan.src.node_id,
            src_address=plan.src.address,
            src_messenger=plan.src.messenger_address,
            dst_node=plan.dst.node_id,
            dst_address=plan.dst.address,
            dst_messenger=plan.dst.messenger_address,
            namespace=plan.namespace,
            key_bytes=b"".join(plan.keys),  # packed: one field, not one per key
            first_block=plan.first_block,
            bytes=plan.nbytes,
            est_seconds=plan.est_seconds,
        )
    return reply
