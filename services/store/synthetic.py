"""Synthetic trajectories (valid under the wire convention) for tests, benchmarks and demos.

Legend: T = routing rows, L = layer columns, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.pb.r3flow.v1 import trajectory_pb2
from services.common.wire import routing_to_proto


def random_routing(rows: int, layers: int, topk: int, num_experts: int,
                   rng: np.random.Generator) -> np.ndarray:
    """[rows, layers, topk] uint8 ids, distinct within each row."""
    keys_TLE = rng.random((rows, layers, num_experts))
    return np.argsort(keys_TLE, axis=-1)[..., :topk].astype(np.uint8)


def build_trajectory(tid: str, group_id: str, group_size: int, *, prompt_ids_TLK: np.ndarray,
                     response_ids_TLK: np.ndarray, segment_lengths: Sequence[int],
                     num_experts: int, seed: int = 0, policy_versions: Sequence[int] = (),
                     split_prompt: bool = True, worker_id: str = "w0") -> trajectory_pb2.Trajectory:
    """A trajectory with P = len(prompt_ids_TLK) prompt tokens and the given segments.

    `response_ids_TLK` holds the R - 1 response rows (R = sum(segment_lengths)); with
    `split_prompt` segment 0 sends the prompt rows as their own chunk (store dedups them).
    """
    rng = np.random.default_rng(seed)
    P, L = prompt_ids_TLK.shape[0], prompt_ids_TLK.shape[1]
    if response_ids_TLK.shape[0] != sum(segment_lengths) - 1:
        raise ValueError("response_ids_TLK: need sum(segment_lengths) - 1 rows")
    prompt_ids: list[int] = np.asarray(rng.integers(0, 50_000, size=P)).tolist()
    traj = trajectory_pb2.Trajectory(
        trajectory_id=tid, group_id=group_id, group_size=group_size, worker_id=worker_id,
        prompt_id=group_id, prompt_token_ids=prompt_ids,
        reward=float(rng.random()), finish_reason=trajectory_pb2.FINISH_REASON_STOP)
    traj.reward_components["correct"] = traj.reward
    all_TLK = np.concatenate([prompt_ids_TLK, response_ids_TLK])
    row, layer_ids = 0, list(range(L))
    for j, n in enumerate(segment_lengths):
        end = P + sum(segment_lengths[: j + 1]) - 1
        seg = traj.segments.add(
            index=j, token_ids=rng.integers(0, 50_000, n).tolist(),
            logprobs=(-rng.random(n)).astype(np.float32).tolist(),
            loss_mask=bytes([1]) * n,
            policy_version=policy_versions[j] if policy_versions else 0)
        if j == 0 and split_prompt:
            seg.routing.append(routing_to_proto(all_TLK[:P], num_experts, start_row=0,
                                                layer_ids=layer_ids))
            row = P
        if end > row:
            seg.routing.append(routing_to_proto(all_TLK[row:end], num_experts, start_row=row,
                                                layer_ids=layer_ids))
        row = end
    return traj


def small_group(group_id: str, group_size: int = 4, *, prompt_len: int = 8,
                segment_lengths: Sequence[int] = (4, 3), layers: int = 2, topk: int = 2,
                num_experts: int = 8, seed: int = 0, policy_version: int = 0
                ) -> list[trajectory_pb2.Trajectory]:
    """A GRPO group of small random trajectories sharing one prompt (and its routing)."""
    rng = np.random.default_rng(seed)
    prompt_TLK = random_routing(prompt_len, layers, topk, num_experts, rng)
    out: list[trajectory_pb2.Trajectory] = []
    for i in range(group_size):
        resp_TLK = random_routing(sum(segment_lengths) - 1, layers, topk, num_experts, rng)
        traj = build_trajectory(
            f"{group_id}/{i}", group_id, group_size, prompt_ids_TLK=prompt_TLK,
            response_ids_TLK=resp_TLK, segment_lengths=segment_lengths,
            num_experts=num_experts, seed=seed * 1000 + i,
            policy_versions=[policy_version] * len(segment_lengths))
        traj.prompt_token_ids[:] = out[0].prompt_token_ids if out else traj.prompt_token_ids
        out.append(traj)
    return out
