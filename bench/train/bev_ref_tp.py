"""DTensor tensor (and sequence) parallelism for the PyTorch reference BEV model (torch_bev_ref.py
--tp N [--sp]), as PyTorch's documentation and torchtitan apply it: the fused qkv rows reordered so
that a contiguous Colwise shard gives each rank whole heads, the ViT blocks' parallel plan, and the
optimizer groups split by parameter kind for the fused AdamW kernel."""

import torch

from bev_ref_model import Attention

def reorder_qkv_for_tp(model, tp):
    """Rows of every fused qkv [3 D, D] (and its bias) from [q; k; v] to [q_0 k_0 v_0; q_1 k_1 v_1; ...]
    (q_r: rank r's D/tp rows of q), so that a contiguous split into tp chunks gives each rank its own
    heads' q, k and v in the [3, H/tp, hd] order Attention.forward views them in."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Attention):
                d3 = m.qkv.weight.shape[0]
                d = d3 // 3
                if d % (tp * m.head_dim):
                    raise SystemExit(f"torch_bev_ref: {d // m.head_dim} heads are not divisible by tp {tp}")
                idx = torch.arange(d3).view(3, tp, d // tp).transpose(0, 1).reshape(-1)
                m.qkv.weight.copy_(m.qkv.weight[idx])
                if m.qkv.bias is not None:
                    m.qkv.bias.copy_(m.qkv.bias[idx])


def apply_dtensor_tp(model, mesh, sp):
    """DTensor tensor (and sequence) parallelism on the ViT blocks of `model` (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    vit = model.encoder.vit
    for name in vit.block_names:
        block = getattr(vit, name)
        if sp:
            plan = {
                "norm1": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                "norm2": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.fc1": ColwiseParallel(),
                "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                    "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
    if sp:
        # Into the sequence-parallel region before the first block, out of it after the final norm.
        parallelize_module(getattr(vit, vit.block_names[0]), mesh,
                           PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True))
        parallelize_module(vit.norm, mesh, SequenceParallel())
        parallelize_module(model.encoder.neck, mesh,
                           PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                              use_local_output=True))


def split_dtensor_groups(groups):
    """Each optimizer group split into its DTensor and plain-tensor parameters: the fused AdamW
    kernel takes one kind per call."""
    from torch.distributed.tensor import DTensor
    out = []
    for g in groups:
        for want in (True, False):
            ps = [p for p in g["params"] if isinstance(p, DTensor) == want]
            if ps:
                out.append({**g, "params": ps})
    return out
