"""Requests that no single encoder can encode: the encoder pool is split by modality (say,
encoders 0-1 host the vision tower for image and video, encoder 2 the audio tower) and the
request has items of modalities hosted on different encoders.

The items are grouped by modality. The group of largest estimated encode time is routed by
the policy as any request is (jointly with the prefill worker, for joint); each other group
goes to the encoder hosting its modality that the policy picks for a lone group
(`Policy.share_encoder`: least estimated queue + encode, or random / round robin's own rule).
The groups are encoded in parallel, so the estimate follows the group whose embeddings reach
the prefill worker last. The decision lists one `EncoderShare` per encoder, which the view
books and the completions release.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.cost_model import CostModel, embedding_bytes
from router.types import (
    EncoderShare,
    MediaJob,
    RequestProfile,
    RouteDecision,
    TTFTEstimate,
    WorkerKind,
)
from router.view import ClusterView, unique_items

if TYPE_CHECKING:
    from router.policies import Policy


def split_decision(
    policy: Policy, profile: RequestProfile, view: ClusterView, cost: CostModel
) -> RouteDecision:
    """The decision for a request whose modalities no candidate encoder hosts together
    (ClusterView.encoders_for gave none; every modality has some host, or it raised)."""
    groups = by_modality(profile.items)
    unique = {modality: unique_items(group) for modality, group in groups.items()}
    hosts = {modality: view.encoders_hosting(modality) for modality in groups}
    main = max(sorted(groups), key=lambda m: cost.cheapest_encode_ms(unique[m], hosts[m]))
    sub = RequestProfile(
        profile.num_prompt_tokens,
        groups[main],
        profile.prefix_hashes,
        profile.block_size,
        profile.max_tokens,
    )
    first = policy.decision(sub, view, cost)  # one modality, so never split again
    estimate = first.estimate
    shares = [
        EncoderShare.of(
            first.encoder,
            (main,),
            len(groups[main]),
            first.encode_items,
            estimate.encoder_queue_ms,
            estimate.encode_ms,
            estimate.transfer_ms,
        )
    ]
    for modality in sorted(groups):
        if modality != main:
            encoder = policy.share_encoder(modality, unique[modality], hosts[modality], view, cost)
            shares.append(
                share_on(
                    encoder, modality, groups[modality], unique[modality], first.prefill, view, cost
                )
            )
    last = max(
        shares, key=lambda s: s.queue_ms + s.encode_ms + s.transfer_ms
    )  # the embeddings that arrive last
    estimate = TTFTEstimate.of(
        last.queue_ms,
        last.encode_ms,
        last.transfer_ms,
        estimate.prefill_queue_ms,
        estimate.prefill_ms,
    )
    misses = tuple(item for share in shares for item in share.encode_items)
    return RouteDecision.of(
        first.encoder,
        first.prefill,
        first.decode,
        estimate,
        profile.items,
        misses,
        first.uncached_tokens,
        tuple(shares),
    )


def by_modality(items: tuple[MediaJob, ...]) -> dict[str, tuple[MediaJob, ...]]:
    """The items of each modality, in request order."""
    groups: dict[str, list[MediaJob]] = {}
    for item in items:
        groups.setdefault(item.modality, []).append(item)
    return {modality: tuple(group) for modality, group in groups.items()}


def least_cost_encoder(
    items: tuple[MediaJob, ...], encoders: list[int], view: ClusterView, cost: CostModel
) -> int:
    """The encoder of least estimated queue + encode for `items` (unique); ties: lowest index."""
    costs = cost.encoder_costs_of(items, view.item_holders(items), view)
    return min(encoders, key=costs.__getitem__)


def share_on(
    encoder: int,
    modality: str,
    items: tuple[MediaJob, ...],
    unique: tuple[MediaJob, ...],
    prefill: int,
    view: ClusterView,
    cost: CostModel,
) -> EncoderShare:
    """What `encoder` takes of a split request: `items` (all of one modality, repeats included;
    `unique` without)."""
    misses = tuple(
        [item for item, held in zip(unique, view.item_holders(unique)) if not held >> encoder & 1]
    )
    queue = view.outstanding_ms[WorkerKind.ENCODER][encoder] if misses else 0.0
    transfer = cost.transfer_ms(view.placement(encoder, prefill), embedding_bytes(items))
    return EncoderShare.of(
        encoder,
        (modality,),
        len(items),
        misses,
        queue,
        cost.encode_sum_ms(encoder, misses),
        transfer,
    )
