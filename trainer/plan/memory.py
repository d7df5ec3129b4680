"""Per-rank GPU memory of a megatron-core MoE training job (what `r3flow plan` prints).

The model's sizes are its family's reading of its config.json (`Arch.from_hf_config`,
trainer/plan/layout.py: the family module of model_type maps its own keys,
services.common.families.model_shape), so dense and MoE layers, shared experts, expert widths
and MLA are counted as the family builds them.
An estimate written down so that it can be checked by hand (tests/unit/test_plan.py does):
  * parameters per rank: attention, dense MLPs, shared experts, embeddings and output layer
    split over TP (norms and routers replicated); experts split over EP x expert-TP (model.
    expert_tensor_parallel, 1 by default); layers over PP
    (the per-rank table is the worst stage: first with PP=1 holds embedding and output layer);
  * bytes per parameter (megatron mixed precision): weights at the model dtype; gradients fp32
    when grads are reduced in fp32 (trainer/engine.py: grad_reduce_in_fp32=True); optimizer
    state fp32 Adam moments (8 B) plus fp32 master weights (4 B) when the model is bf16, split
    over the data-parallel ranks of each parameter only with the distributed optimizer
    (dense DP = world / (TP x PP x CP), expert DP = world / (EP x ETP x PP));
  * reference model (kl_coef > 0): a second copy of the weights, no grads, no optimizer;
  * activations per token per layer at the model dtype, tokens per rank = seq_len x micro_batch
    / (TP x CP) (sequence parallel), x PP micro-batches in flight on the first stage (1F1B):
      attention   3h + 2*q + 2*kv  (two norm inputs, QKV input, q/k/v, attention output;
                  q = heads x head_dim, kv = kv_heads x head_dim); MLA: 3h + 2*ql + 2*kl +
                  r + 2*q + 2*v (q and kv latents before and after their norms, the rope key,
                  q, k = q, v = heads x v_head_dim and the attention output)
      MoE block   h + k*(2h + 3f) + 3s + 2E*4/eb  (router input, fp32 router logits and
                  probs, permuted tokens in/out, fc1 gate+up, activation output; the shared
                  expert's fc1 and activation outputs)
      dense MLP   h + 3F
    recompute "moe" keeps only the MoE block's input (h) per layer, "full" only each layer's
    input (h); either adds one recomputed block's activations live during backward. A
    megatron config that leaves recompute unset (Layout.recompute_set False; the trainer then
    recomputes nothing) gets the plan's pick (choose_recompute): the lightest of none, moe,
    full whose total fits, overhead included (issue 44: recompute costs backward time, so none
    whenever it fits); a set recompute (model.recompute_*, `--recompute`) is planned as set;
  * attention scores: the trainer builds megatron's local spec, whose DotProductAttention is
    unfused (megatron.core.transformer.dot_product_attention, masked_softmax_fusion off): per
    layer it keeps the softmax's fp32 output (4 B) and its bf16 cast that the PV matmul saves
    (2 B; fp32 model: the one fp32 tensor, 4 B) for every score of micro_batch x heads/TP x
    seq_len^2 (the full sequence: SP gathers it before attention), in every layer that is not
    recomputed (recompute "moe" keeps them, "full" holds one layer's, live in that layer's
    backward, after the loss buffers below are freed: the sum over-counts it then); plus
    megatron's global memory buffer that baddbmm takes as its input, eb x one layer's scores,
    allocated once. With model.attention sdpa (Layout.attention, the fused kernel) neither:
    each layer keeps the kernel's fp32 logsumexp, 4 B x micro_batch x heads/TP x seq_len;
  * loss: the trainer's loss works on the full [B, S, V] logits (the trainer gathers them over
    TP, parallel_output=False, so every TP rank holds the full vocabulary; PP: the last
    stage). trainer/losses/loss.py's ppo_loss takes two fp32 log-softmaxes (token_logprobs and
    token_entropy each upcast and normalise the logits) and exp of the second; autograd keeps
    all three (3 x 4 B per logit), and the entropy's backward materialises three more fp32
    gradients of that size before any is freed: 24 B per logit at the peak, at the start of
    the update's backward when every layer's activations are still held (any model dtype;
    measured on CPU with ru_maxrss over ppo_loss forward + backward: 6.05 x 4 B bf16, 6.05 x
    4 B fp32; forward alone 4.5 x 4 B). With loss.chunked_logprobs (Layout.chunked_logprobs,
    trainer/losses/logprobs.py) no fp32 [B, S, V] tensor: the bf16 logits it saves for backward and
    their bf16 gradient (4 B per logit), plus one chunk's fp32 temporaries in the backward
    (~6 x LOSS_CHUNK_ROWS x V x 4 B: logp, p, the gradient and their products; fitted to the
    four H200 peaks of BENCHMARKS.md "Call 5", within 6 %);
  * routing replay (replay_bytes; Layout.replay, Layout.microbatches: the micro-batches of one
    step on a rank, its TP x PP group's share of data.groups_per_step x group size, over
    micro_batch). r3: every micro-batch moves to the device with its rollout routing in the
    codec's dtype (uint8 up to 256 experts, else uint16; MicroBatch.to) for the whole step, all
    MoE layers and positions ("replay ids"); r2: the ids it recorded, in the same dtype, its
    stage's MoE layers and its SP/CP shard of the positions. Each forward widens its
    micro-batch's ids of this rank to the routers' int64 rows (its stage's MoE layers, its
    SP/CP shard) and they live until its backward: the micro-batches in flight hold them, PP of
    them on the first stage of a 1F1B pipeline, one without PP ("replay rows"). Checking one
    micro-batch's rows briefly holds ~4 int64 copies of it (widening, the routing rules' masked
    copy, sort values and indices) before the pass's first forward, when no activation is
    held: not at the peak, not counted;
  * the weight push (push_bytes): the sender's buckets in flight and the chunks it gathers
    from the other ranks (streamed: no rank holds the whole model), each the bucket size or
    the family's largest tensor when larger (push_chunk_bytes: GPT-OSS's fused experts, a
    large vocabulary's embedding); the rollout side's staging ring is printed as a note
    (rollout_staging_bytes);
  * hf backend (Layout.fsdp, FSDP2): fp32 parameters, fp32 gradients and Adam moments (8 B),
    each sharded over the shard group (the world, or hf.shard_group_size with hybrid
    sharding), plus what is gathered at a time (fsdp_state_bytes): the largest decoder layer's
    parameters at the compute dtype, two in flight (FSDP2 prefetches the next), and that
    layer's unsharded fp32 gradient before its reduce-scatter; activations as above
    (attention: hf.attn_implementation);
  * a colocated vLLM engine's share (gpu_memory_utilization of the same GPU; 0 when rollout
    runs in its own pods, as in the chart) and a fixed runtime overhead (CUDA context, NCCL
    buffers, allocator fragmentation).
Legend: h hidden, f expert FFN, F dense FFN, s shared experts' FFN, k top-k, E experts, eb bytes
per element, ql/kl/r MLA's q_lora_rank/kv_lora_rank/qk_rope_head_dim.
"""

from __future__ import annotations

from dataclasses import replace

from services.common.errors import UserError
from services.common.routing_size import ids_dtype_bytes
from trainer.plan.advice import what_to_change
from trainer.plan.layout import RECOMPUTES, Arch, GiB, Layout, Plan, Recompute


def params_per_rank(arch: Arch, lay: Layout) -> tuple[float, float]:
    """(dense, expert) parameters held by the most loaded rank (first stage)."""
    split, repl = arch.attention_params()
    moe_split, moe_repl = arch.moe_dense_params()  # shared expert; router (+ gate)
    per_stage = arch.num_layers // lay.pp
    moe = arch.moe_layers * per_stage / arch.num_layers
    dense_mlp = arch.dense_layers * per_stage / arch.num_layers
    emb = arch.vocab * arch.hidden
    # Embedding on the first stage, output layer on the last: both on one rank only with PP=1.
    emb_rank = emb * (1 if (arch.tied_embeddings or lay.pp > 1) else 2)
    dense = (per_stage * split + moe * moe_split + dense_mlp * 3 * arch.hidden * arch.dense_ffn
             + emb_rank) / lay.tp
    dense += per_stage * repl + moe * moe_repl + arch.hidden
    expert = moe * arch.expert_params_per_layer / (lay.ep * lay.etp)
    return dense, expert


def _state_bytes(lay: Layout, dense: float, expert: float) -> dict[str, float]:
    eb = 2 if lay.dtype == "bf16" else 4
    grad = 4 if (lay.grad_reduce_in_fp32 or lay.dtype == "fp32") else 2
    optim = 12 if lay.dtype == "bf16" else 8  # Adam m, v (+ fp32 master weights for bf16)
    if lay.distributed_optimizer:
        optimizer = optim * (dense / lay.dp + expert / lay.expert_dp)
    else:
        optimizer = optim * (dense + expert)
    params = dense + expert
    return {"weights": eb * params, "grads": grad * params, "optimizer": optimizer,
            "reference model": eb * params if lay.reference else 0.0}


def fsdp_state_bytes(arch: Arch, lay: Layout) -> dict[str, float]:
    """The hf backend's FSDP2 state per rank (module docstring)."""
    dense, expert = params_per_rank(arch, lay)
    shard = (dense + expert) / lay.shard
    split, repl = arch.attention_params()
    moe = arch.expert_params_per_layer + sum(arch.moe_dense_params()) if arch.moe_layers else 0
    layer = split + repl + max(moe, 3 * arch.hidden * arch.dense_ffn)
    eb = 2 if lay.dtype == "bf16" else 4
    return {"weights": 4 * shard, "grads": 4 * shard, "optimizer": 8 * shard,
            "gathered layers": (2 * eb + 4) * layer,
            "reference model": 4 * shard if lay.reference else 0.0}


LOSS_CHUNK_ROWS = 1024  # trainer.losses.logprobs.CHUNK (tests/unit/test_plan.py keeps them equal)


def attention_elems(arch: Arch) -> int:
    """Elements per token an attention block keeps for backward (module docstring): its two
    norm inputs and the projections' input, q, k, v and the attention output; MLA adds its
    q and kv latents (each before and after its norm) and the shared rope key."""
    a, h = arch.attention, arch.hidden
    if not a.mla:
        return 3 * h + 2 * a.q_width + 2 * a.kv_heads * a.head_dim
    latents = 2 * a.q_lora_rank + 2 * a.kv_lora_rank + a.rope_head_dim
    return 3 * h + latents + 2 * a.q_width + 2 * a.v_width


def activation_bytes(arch: Arch, lay: Layout) -> dict[str, float]:
    """Activations, attention scores and the loss's logits of the first (and, PP=1, last)
    stage."""
    eb = 2 if lay.dtype == "bf16" else 4
    h = arch.hidden
    tokens = lay.seq_len * lay.micro_batch / (lay.tp * lay.cp)
    attn = attention_elems(arch)
    moe = (h + arch.top_k * (2 * h + 3 * arch.moe_ffn) + 3 * arch.shared_ffn
           + 2 * arch.experts * 4 / eb)
    mlp = h + 3 * arch.dense_ffn
    per_stage = arch.num_layers // lay.pp
    moe_n = arch.moe_layers * per_stage / arch.num_layers
    dense_n = per_stage - moe_n
    if lay.recompute == "none":
        elems, live = moe_n * (attn + moe) + dense_n * (attn + mlp), 0.0
    elif lay.recompute == "moe":
        elems, live = moe_n * (attn + h) + dense_n * (attn + mlp), moe if moe_n else 0.0
    else:
        elems, live = per_stage * h, attn + (moe if moe_n else mlp)
    in_flight = lay.pp
    acts = eb * tokens * (elems * in_flight + live)
    # unfused attention: [micro_batch, heads/TP, S, S] scores per layer (module docstring);
    # sdpa (fused) keeps no scores, only its fp32 logsumexp per query row and head
    scores = lay.micro_batch * arch.heads / lay.tp * lay.seq_len ** 2 / lay.cp
    kept = (4 + eb if eb == 2 else 4) * scores
    kept_layers = 1 if lay.recompute == "full" else per_stage * in_flight
    if lay.attention == "sdpa":
        kept, scores = 4 * scores / lay.seq_len, 0.0
    logits = lay.seq_len * lay.micro_batch / lay.cp * arch.vocab
    loss_logits = 4 * logits + 6 * 4 * LOSS_CHUNK_ROWS * arch.vocab if lay.chunked_logprobs \
        else 24 * logits
    return {"activations": acts, "attention scores": kept * kept_layers,
            "attention buffer": eb * scores, "logits + loss": loss_logits}


def replay_bytes(arch: Arch, lay: Layout) -> dict[str, float]:
    """Routing replay's tensors on the device (module docstring): the step's micro-batches'
    ids in the codec dtype, held for the step (r3: the rollout's; r2: the recorded ones of this
    rank), and the int64 router rows of the micro-batches in flight."""
    if lay.replay == "off" or not arch.moe_layers:
        return {}
    stage_moe = arch.moe_layers * (arch.num_layers // lay.pp) / arch.num_layers
    local_tokens = lay.seq_len * lay.micro_batch / (lay.tp * lay.cp)
    rows = replay_in_flight(lay) * 8 * local_tokens * stage_moe * arch.top_k
    width = ids_dtype_bytes(arch.experts)
    if lay.replay == "r2":
        ids = lay.microbatches * local_tokens * stage_moe * arch.top_k * width
    else:
        ids = lay.microbatches * lay.micro_batch * lay.seq_len * arch.moe_layers * arch.top_k \
            * width
    return {"replay ids": ids, "replay rows": rows}


def replay_in_flight(lay: Layout) -> int:
    """Micro-batches whose int64 router rows are alive at once: forwards whose backward has
    not run (1F1B: PP of them on the first stage), at most the step's."""
    return min(lay.pp, lay.microbatches)


PUSH_CHUNK_DEPTH = 3  # export_stream.HFStream: 2 chunks in flight + the one being filled
RX_STAGING_SLOTS = 3  # weight_sync.receiver_stream.DEFAULT_SLOTS


def push_chunk_bytes(arch: Arch, lay: Layout) -> int:
    """A push bucket as sent: `push_bucket_bytes`, or the model's largest tensor at the model
    dtype when that is larger (a chunk never splits a tensor: export_stream.cut_chunks; the
    rollout's staging ring grows to the largest bucket: receiver_stream)."""
    eb = 2 if lay.dtype == "bf16" else 4
    return max(lay.push_bucket_bytes, eb * arch.largest_tensor()) if lay.push_bucket_bytes else 0


def push_bytes(arch: Arch, lay: Layout) -> dict[str, float]:
    """The streamed weight push on the trainer's worst rank (the sender, rank 0): its pack
    buffers (inflight x bucket), the chunks it receives from other ranks (PUSH_CHUNK_DEPTH x
    bucket; a non-sender rank holds as many it sends) and up to one bucket of sources awaiting
    their pack; a bucket is push_chunk_bytes (the family's largest tensor when that is larger).
    Measured on H200s at Qwen3-30B-A3B size (BENCHMARKS.md): within 2 GiB of it."""
    b = push_chunk_bytes(arch, lay)
    return {"weight push": (lay.push_inflight + PUSH_CHUNK_DEPTH + 1) * b} if b else {}


def rollout_staging_bytes(bucket_bytes: int) -> int:
    """Push staging on each rollout engine rank: the receiver's ring (RX_STAGING_SLOTS
    buckets of push_chunk_bytes, weight_sync.receiver_stream), kept between pushes; leave it
    outside vLLM's gpu_memory_utilization."""
    return RX_STAGING_SLOTS * bucket_bytes


def plan(arch: Arch, lay: Layout, gpu_gib: float, overhead_gib: float = 4.0,
         vllm_share: float = 0.0) -> Plan:
    """The per-rank memory table of `lay` on a GPU of `gpu_gib` GiB, with its recompute line:
    for a megatron layout the recompute the budget allows (choose_recompute), and when the
    config leaves recompute unset and the trainer's none does not fit, the setting that fits."""
    out = _plan(arch, lay, gpu_gib, overhead_gib, vllm_share)
    if not out.fits:
        out.notes.append(what_to_change(out.rows, out.total - out.gpu_bytes, lay,
                                        out.dense_params >= out.expert_params))
    if lay.fsdp:
        return out
    pick, totals = choose_recompute(arch, lay, gpu_gib, overhead_gib, vllm_share)
    est = ", ".join(f"{r} {t / GiB:.2f}" for r, t in totals.items())
    if lay.recompute_set:
        out.recompute = (f"recompute: {lay.recompute}, as set (the plan's pick would be "
                         f"{pick}; GiB per rank by recompute: {est})")
    elif pick == lay.recompute:
        out.recompute = (f"recompute: {pick}, the plan's pick (unset in the config): the "
                         f"lightest whose estimate fits {gpu_gib:.2f} GiB with "
                         f"{overhead_gib:.2f} GiB overhead (GiB per rank: {est})")
    else:
        setting = {"moe": "model.recompute_moe: true",
                   "full": "model.recompute_granularity: full"}.get(pick, pick)
        fits = "fits" if totals[pick] <= gpu_gib * GiB else "still does not fit"
        out.recompute = (f"recompute: unset in the config, so the trainer runs "
                         f"{lay.recompute}, which does not fit; the plan's pick is {pick} "
                         f"({fits}): set {setting} (GiB per rank: {est})")
    return out


def choose_recompute(arch: Arch, lay: Layout, gpu_gib: float, overhead_gib: float = 4.0,
                     vllm_share: float = 0.0) -> tuple[Recompute, dict[str, float]]:
    """The lightest recompute (none, then moe, then full) whose per-rank total fits `gpu_gib`
    with the runtime overhead (the plan's margin), or full when none does; and the totals in
    bytes of those tried, lightest first (moe only with MoE layers)."""
    totals: dict[str, float] = {}
    for r in RECOMPUTES:
        if r == "moe" and not arch.moe_layers:
            continue
        totals[r] = _plan(arch, replace(lay, recompute=r), gpu_gib, overhead_gib,
                          vllm_share).total
        if totals[r] <= gpu_gib * GiB:
            return r, totals
    return "full", totals


def _plan(arch: Arch, lay: Layout, gpu_gib: float, overhead_gib: float,
          vllm_share: float) -> Plan:
    lay.check(arch)
    if not 0.0 <= vllm_share < 1.0:
        raise UserError(f"vllm_share: {vllm_share} is not in [0, 1)")
    dense, expert = params_per_rank(arch, lay)
    state = fsdp_state_bytes(arch, lay) if lay.fsdp else _state_bytes(lay, dense, expert)
    if lay.fsdp:
        dense, expert = dense / lay.shard, expert / lay.shard
    rows = state | activation_bytes(arch, lay) | replay_bytes(arch, lay) | push_bytes(arch, lay)
    rows["vLLM KV share"] = vllm_share * gpu_gib * GiB
    rows["runtime overhead"] = overhead_gib * GiB
    out = Plan(rows=rows, gpu_bytes=gpu_gib * GiB, dense_params=dense, expert_params=expert)
    if lay.push_bucket_bytes:
        out.notes.append(f"rollout engine ranks: weight-push staging "
                         f"{rollout_staging_bytes(push_chunk_bytes(arch, lay)) / GiB:.2f} GiB each "
                         f"({RX_STAGING_SLOTS} buckets) outside gpu_memory_utilization")
    if "replay rows" in rows:
        out.notes.append(f"replay {lay.replay}: the routing of {lay.microbatches} micro-batch(es) "
                         f"of {lay.micro_batch} x {lay.seq_len} tokens stays on the device for "
                         f"the step (replay ids), widened to int64 for the "
                         f"{replay_in_flight(lay)} in flight (replay rows)")
    if lay.fsdp:
        out.notes.append(f"hf backend: FSDP2, every weight sharded over {lay.shard} rank(s), "
                         f"{lay.world // lay.shard} replica(s)")
    elif not lay.distributed_optimizer and (lay.dp > 1 or lay.expert_dp > 1):
        out.notes.append("optimizer state is not sharded (no distributed optimizer)")
    return out


def format_plan(p: Plan, title: str) -> str:
    """A table of GiB per row, the total against the GPU, and the verdict."""
    lines = [title, f"  params per rank: {p.dense_params:,.0f} dense + "
                    f"{p.expert_params:,.0f} expert"]
    lines += [f"  {p.recompute}"] if p.recompute else []
    lines += [f"  {name:<18} {value / GiB:>9.2f} GiB" for name, value in p.rows.items()]
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines.append(f"  {'total':<18} {p.total / GiB:>9.2f} GiB of {p.gpu_bytes / GiB:.2f} GiB: "
                 f"{verdict} ({(p.gpu_bytes - p.total) / GiB:+.2f} GiB)")
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)
