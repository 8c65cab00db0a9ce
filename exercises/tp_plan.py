"""Exercise 12: the tensor-parallel plan of a Llama-like block (sequence parallel too).

Run it (2 or 4 processes), from notebook 12 or from the repository root::

    result = ddplab.launch("../exercises/tp_plan.py", 2)
    ddplab.check("12", result)

    python -m ddplab launch --nproc-per-node 2 exercises/tp_plan.py

``Block`` below is one layer of a Llama-like model: RMSNorm, multi-head causal attention
(``wq``, ``wk``, ``wv``, ``wo``), RMSNorm, a SwiGLU feed-forward (``w2(silu(w1(x)) * w3(x))``),
each sub-block inside a residual sum. Write ``parallelize`` from its docstring: it decides how
each part of the block is split over the mesh's ranks (``parallelize_module`` and the styles of
``torch.distributed.tensor.parallel``: look them up, with PyTorch's tensor-parallel tutorial,
https://docs.pytorch.org/tutorials/intermediate/TP_tutorial.html).
Leave ``Block`` as it is: what must change in a module for the sharded run, your function sets.

The fixed part builds the block twice from one seed, hands one copy to your ``parallelize``,
runs both on the same input, and reports (``metric`` events): what your plan did to each weight
(``placements``) and to the attention's head count (``n_heads``, with each rank's rows of
``wq``: ``wq_rows``), how many tokens each RMSNorm ran on per rank (``norm_tokens``), what
each residual sum of ``Block.forward`` added on this rank (``residual_sides``: each side a
DTensor or a plain tensor, and its tokens), the largest differences from the unsharded
block of the output, of every parameter's gradient and of the input's gradient, the
collectives of one forward and one backward (counted with ``CommDebugMode``), and an
``error`` if your plan, the forward or the backward raised.

Lesson: 12.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: F401  (you will need them)
from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401  (and its styles)

from ddplab import dist, events
from ddplab.sharded import collectives

DIM, N_HEADS, HIDDEN = 16, 4, 32        # width, attention heads, feed-forward hidden units
BATCH, SEQ = 2, 8                       # the input: 2 sequences of 8 tokens


# [block]
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention(DIM, N_HEADS)
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), FeedForward(DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))
# [/block]


# [exercise]
def parallelize(block: Block, mesh: DeviceMesh) -> nn.Module:
    """Split ``block`` over the N ranks of the 1-D ``mesh``; return the module to run.

    What must hold of the run:

    - The block is called with the whole input ``x`` (batch, seq, dim) on every rank, a plain
      tensor, and returns the whole output on every rank, a plain tensor, equal to the unsharded
      block's (and so are the gradients of every weight and of ``x``).
    - Each rank holds 1/N of every linear layer's weight: attention by heads (each rank computes
      N_HEADS / N whole heads), the feed-forward by hidden units; each sub-block's partial
      results are summed once, at its last layer.
    - The two RMSNorms and the residual sums run sequence-parallel: each rank on its 1/N of the
      sequence, with the norms' weights replicated.
    - No more communication than needed: the judge counts the collectives of one forward and one
      backward, and compares them with those of the reference plan.
    """
    # TODO(exercise): write this function from its docstring.
    return block
# [/exercise]


def whole(t: Any) -> torch.Tensor:
    """The whole tensor a DTensor stands for (a collective); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def gap(mine: Any, theirs: torch.Tensor) -> Any:
    """Largest absolute difference, or None when there is nothing comparable."""
    if mine is None:
        return None
    mine = whole(mine)
    if mine.shape != theirs.shape:
        return None
    return float((mine.detach() - theirs.detach()).abs().max())


def side(t: Any) -> dict[str, Any]:
    """One side of a residual sum as this rank holds it: a DTensor or not, and its tokens."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return {"type": "DTensor" if isinstance(t, DTensor) else "Tensor", "tokens": local.shape[1]}


def placement(p: torch.Tensor) -> str:
    return str(list(p.placements)) if isinstance(p, DTensor) else "not a DTensor"


def local_rows(p: torch.Tensor) -> int:
    return (p.to_local() if isinstance(p, DTensor) else p).shape[0]


def main() -> None:
    info = dist.setup(timeout_s=60)
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    torch.manual_seed(0)
    reference = Block().to(info.device)                  # the unsharded block ...
    block = copy.deepcopy(reference)                     # ... and the same weights, for the plan
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, device=info.device)
    x_mine, x_reference = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    facts: dict[str, Any] = {"world_size": info.world_size, "seq": SEQ, "n_heads_full": N_HEADS,
                             "head_dim": DIM // N_HEADS}
    stage = "parallelize"
    try:
        model = parallelize(block, mesh)
        attention = model.attention
        facts.update(n_heads=attention.n_heads, wq_rows=local_rows(attention.wq.weight),
                     placements={n: placement(p) for n, p in model.named_parameters()})
        tokens: dict[str, int] = {}
        for name in ("attention_norm", "ffn_norm"):    # what each norm ran on, on this rank
            getattr(model, name).register_forward_hook(
                lambda module, args, out, name=name: tokens.__setitem__(
                    name, (out.to_local() if isinstance(out, DTensor) else out).shape[1]))
        sides: dict[str, Any] = {}     # x + attention(...), then h + feed_forward(...)
        facts["residual_sides"] = sides
        for name, residual in (("attention_norm", "x"), ("ffn_norm", "h")):
            getattr(model, name).register_forward_pre_hook(    # before any hook of the plan
                lambda module, args, residual=residual: sides.__setitem__(residual, side(args[0])),
                prepend=True)
        for name in ("attention", "feed_forward"):             # after every hook of the plan
            getattr(model, name).register_forward_hook(
                lambda module, args, out, name=name: sides.__setitem__(name, side(out)))
        stage = "forward"
        with collectives() as forward:
            out = model(x_mine)
        facts.update(norm_tokens=tokens, forward_collectives=forward,
                     output_type="DTensor" if isinstance(out, DTensor) else "Tensor",
                     output_shape=list(out.shape) if not isinstance(out, DTensor)
                     else list(out.to_local().shape))
        stage = "backward"
        with collectives() as backward:
            whole(out).pow(2).sum().backward()
        facts.update(backward_collectives=backward)
    except Exception as error:                           # the plan is the learner's: report it
        text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        print(f"rank {info.rank}: {stage} raised {type(error).__name__}: {text}", flush=True)
        events.emit("metric", name="tp_plan", value=facts)
        events.emit("metric", name="error", value={"stage": stage, "type": type(error).__name__,
                                                   "message": text})
        dist.cleanup()
        return
    expected = reference(x_reference)
    expected.pow(2).sum().backward()
    facts.update(
        output_error=gap(out, expected) if not isinstance(out, DTensor) else None,
        input_grad_error=gap(x_mine.grad, x_reference.grad),
        grad_errors={n: gap(p.grad, r.grad) for (n, p), r in zip(model.named_parameters(),
                                                                 reference.parameters())})
    events.emit("metric", name="tp_plan", value=facts)
    dist.cleanup()


if __name__ == "__main__":
    main()
