"""The course's plan for notebook 12's exercise 2 (``exercises/tp_plan.py``): the Llama-like
block under tensor parallel with sequence parallel. Notebook 12 imports and shows it only once
the learner's own plan is judged right; nothing else in the course imports it (the tests do).

Lesson: 12.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)


# [llama_plan]
def llama_plan(block: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """A plan for the Llama-like block of exercises/tp_plan.py, taking and giving whole sequences.

    Sequence parallel around the sub-blocks (norms and residual sums on 1/N of the tokens);
    before each sub-block one all-gather of the sequence, inside it column-wise then row-wise,
    after it one reduce-scatter back to the slices.
    """
    for name, (first, last) in {"attention": (("wq", "wk", "wv"), "wo"),
                                "feed_forward": (("w1", "w3"), "w2")}.items():
        sub = getattr(block, name)
        styles = {layer: ColwiseParallel() for layer in first}
        styles[last] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(sub, mesh, styles)
        parallelize_module(sub, mesh, PrepareModuleInput(input_layouts=Shard(1),
                                                         desired_input_layouts=Replicate()))
    for name in ("attention_norm", "ffn_norm"):
        parallelize_module(getattr(block, name), mesh, SequenceParallel())
    # Attention.forward views q, k, v with self.n_heads: this rank holds only its heads.
    rows = block.attention.wq.weight.to_local().shape[0]
    block.attention.n_heads = rows // block.attention.head_dim
    # The block takes and gives whole sequences: sliced on the way in, gathered on the way out.
    # (PrepareModuleInputOutput does both in one style, in torch releases after 2.7.)
    parallelize_module(block, mesh, PrepareModuleInput(
        input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True))
    return parallelize_module(block, mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate()))
# [/llama_plan]
