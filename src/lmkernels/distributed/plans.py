"""A sequence-parallel tensor-parallel plan for transformers' Llama-style causal LMs, in torch's
parallel styles (torchtitan's layout), for `torch.distributed.tensor.parallel.parallelize_module`
on the tp mesh (dim) and FSDP2 on the dp dim:

    model = lk_hf.apply(AutoModelForCausalLM.from_config(config))
    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], sequence_parallel_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model.lm_head, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    positions = torch.arange(seq, device=ids.device).expand(batch, -1)
    loss = model(input_ids=ids, labels=ids, position_ids=positions).loss

Between the blocks the residual stream is sharded on the sequence (each tp rank holds seq / tp
positions): the embedding's output is reduce-scattered onto the sequence, the norms run on the
local positions (SequenceParallel; the patched RMSNorm runs its kernel on the local rows,
lmkernels.distributed.local), attention and MLP all-gather their input to the whole sequence
(PrepareModuleInput) and compute on their heads / columns (q/k/v/gate/up colwise), and o/down
(rowwise) reduce-scatter back onto the sequence. lm_head is colwise (vocabulary-sharded): the
patched model's loss is the vocab-parallel FLCE on the tp group, on the gathered final hidden
states; an unpatched model gets logits gathered over the vocabulary (`lm_head_output`).

`position_ids` must be passed: transformers derives the positions from the length of the
embedding's output, which is seq / tp here. With them (and no attention mask) the causal mask
transformers builds is SDPA's is_causal over the gathered sequence. A padded batch (an
attention_mask) is not supported by this plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


def sequence_parallel_plan(
    model: nn.Module, *, lm_head_output: Literal["replicate", "shard"] = "replicate"
) -> dict[str, ParallelStyle]:
    """{module name: parallel style} for `parallelize_module(model, tp_mesh, plan)`.
    `model`: a transformers causal LM with model.embed_tokens, model.layers[i].{input_layernorm,
    self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm,
    lm_head (Llama, Mistral, Qwen2/3 and the like). `lm_head_output`: "replicate" (logits gathered
    over the vocabulary, what transformers' loss takes) or "shard" (vocabulary-sharded DTensor
    logits, for `torch.distributed.tensor.parallel.loss_parallel`). The patched loss never calls
    lm_head, so this only matters to unpatched models and generation."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if lm_head_output not in ("replicate", "shard"):
        raise ValueError(f"lm_head_output: expected 'replicate' or 'shard', got {lm_head_output!r}")
    head_out = Replicate() if lm_head_output == "replicate" else Shard(-1)
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=head_out, use_local_output=lm_head_output == "replicate"
        ),
    }
    base: Any = model.model  # duck-typed: a transformers base model
    for i in range(len(base.layers)):
        p = f"model.layers.{i}."
        plan |= {
            p + "input_layernorm": SequenceParallel(),
            # transformers' decoder layers call self_attn with keyword arguments, mlp positionally
            p + "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            ),
            p + "self_attn.q_proj": ColwiseParallel(),
            p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(),
            p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            p + "post_attention_layernorm": SequenceParallel(),
            p + "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
            p + "mlp.gate_proj": ColwiseParallel(),
            p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan
