"""Solution of exercise 11b: shard a small transformer with FSDP2, estimate its bytes per
rank, and save it with a distributed checkpoint that loads on any number of ranks. Four functions.

Run it from notebook 11 (three launches: train and save on 2 ranks, load on 4, load in one
process; about 10 s in all), or from the repository root::

    python -m ddplab launch --nproc-per-node 2 exercises/fsdp2.py --save ckpt/fsdp2
    python -m ddplab launch --nproc-per-node 4 exercises/fsdp2.py --load ckpt/fsdp2
    python exercises/fsdp2.py --load ckpt/fsdp2

and hand the three results to the judge: ``ddplab.check("11b", {"save": ..., "load4": ...,
"load1": ...})``.

Given (the fixed part, below your four functions): the model (``Transformer``: token and
position embeddings, ``BLOCKS`` pre-norm ``Block``s of attention and MLP, a final norm, a head),
the data (``batch``: sequences that count up in steps), the command line, the training loop
(Adam, ``STEPS`` steps) and the reports the judge reads. Look up ``fully_shard`` and
``MixedPrecisionPolicy`` (``torch.distributed.fsdp``), ``torch.distributed.checkpoint``, and
``get_state_dict`` / ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``).

What must be true of a run, and why
-----------------------------------

1. **Sharded block by block.** ``shard`` makes every parameter a shard: each rank stores 1/N
   of each. Forward gathers the weights block by block, each block's just before it runs, and
   frees them after it: never the whole model at once (that is what sharding is for).
2. **Mixed precision, as the reference computes.** Forward and backward compute in the
   16-bit floating-point type that needs no loss scaling (nothing in this loop scales the
   loss), bfloat16, as ``one_process`` below does, on a CPU with gloo as on a GPU; the shards
   each rank stores are not cast (they keep the dtype the model was built in), and the
   gradients are averaged over the ranks in float32.
3. **An estimate before the run.** ``bytes_per_rank`` predicts, from the number of parameters
   and of ranks alone, what one rank stores for the weights, their gradients and Adam's two
   moments. The fixed part measures it after a step: the estimate must match within 1%.
4. **The same training as one process.** The sharded run's losses and trained weights equal
   those of the same model trained by one process on the whole batches, up to rounding: each
   step's loss within 0.005, the weights within 15% of how far training moved them (Adam's
   first steps move a weight by about the learning rate even when bfloat16 rounds its
   gradient across zero).
5. **A checkpoint for any world size.** ``save`` writes the model and Adam's state (both
   moments, and its step) into the folder ``path``, without gathering the model on one rank;
   ``load`` fills a freshly built model and optimizer from it, on 4 ranks or in one
   process (no process group there: the model is not sharded), bit for bit what was saved.

Lesson: 11.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ddplab import dist, events
from ddplab.sharded import collectives, fsdp_problem, local_bytes, optimizer_bytes

VOCAB, DIM, HEADS, BLOCKS, SEQ = 64, 32, 4, 3, 16
STEPS, BATCH, LR = 4, 16, 1e-2  # BATCH: sequences per step, over every rank together


# [exercise]
def shard(model: "Transformer", mesh: DeviceMesh) -> None:
    """Shard ``model`` over ``mesh`` with FSDP2, as points 1 and 2 of the spec ask."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:                  # one all-gather per block, each in its turn
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)   # last: what no block took


def bytes_per_rank(num_params: int, world_size: int) -> int:
    """Bytes one rank stores for the weights, their gradients and Adam's two moments, when
    ``num_params`` parameters are sharded over ``world_size`` ranks (point 3)."""
    return 16 * num_params // world_size        # 4 + 4 + 2 x 4, float32, 1/N of each


def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Write model and optimizer into the folder ``path`` (point 5); every rank calls it."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Fill ``model`` and ``optimizer`` from the folder ``path`` (point 5); every rank calls
    it."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
# [/exercise]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """A tiny GPT: embeddings, ``BLOCKS`` blocks, a final norm and a head over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch: sequences that count up from a start by a stride (mod
    VOCAB); the target of each token is the next one."""
    g = torch.Generator().manual_seed(step)
    start, stride = torch.randint(VOCAB, (BATCH, 1), generator=g), torch.randint(1, 4, (BATCH, 1),
                                                                                 generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def step_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


def digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """A fingerprint of every weight and of Adam's state, whole (a collective when sharded)."""
    found = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        for what, t in (("weight", p), *((k, state[k]) for k in ("exp_avg", "exp_avg_sq", "step")
                                         if k in state)):
            data = full(t).cpu().numpy().tobytes()
            found[f"{name}:{what}"] = hashlib.sha256(data).hexdigest()[:16]
    return found


def one_process(model: nn.Module, steps: int) -> tuple[list[float], nn.Module]:
    """The reference: ``model`` trained on the whole batches by this process alone, with the
    arithmetic of bfloat16 mixed precision (a bfloat16 copy computes, float32 weights step)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        half = copy.deepcopy(model).to(torch.bfloat16)
        loss = step_loss(half, *batch(step))
        loss.backward()
        for p, h in zip(model.parameters(), half.parameters()):
            p.grad = h.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def averaged_in(model: nn.Module) -> str:
    """The dtype the ranks averaged the gradients in, read after a backward: the narrowest
    type that holds every gradient exactly (an average of bfloat16 gradients taken in float32
    is, in general, no bfloat16 value)."""
    grads = [g.to_local() if isinstance(g, DTensor) else g
             for g in (p.grad for p in model.parameters()) if g is not None]
    for dtype in (torch.bfloat16, torch.float16):
        if grads and all(torch.equal(g, g.to(dtype).to(g.dtype)) for g in grads):
            return str(dtype).split(".")[-1]
    return str(grads[0].dtype).split(".")[-1] if grads else "none"


def train(model: nn.Module, optimizer: torch.optim.Optimizer, info: dist.DistInfo) -> None:
    """``STEPS`` steps on this rank's share of each batch; report what the judge needs."""
    share = BATCH // info.world_size
    for step in range(STEPS):
        tokens, targets = (t[info.rank * share:(info.rank + 1) * share].to(info.device)
                           for t in batch(step))
        with collectives() as gathered:
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        held = {"params": local_bytes(model.parameters()),
                "grads": local_bytes(p.grad for p in model.parameters())}
        averaged = averaged_in(model)
        optimizer.step()
        optimizer.zero_grad()
        held["optimizer"] = optimizer_bytes(optimizer)
        mean = dist.all_reduce_mean(loss.item(), info.device)
        if info.is_main:
            events.emit("metric", name="loss", step=step, value=mean)
    events.emit("metric", name="held", value=held)
    events.emit("metric", name="forward", value={"dtype": str(logits.dtype).split(".")[-1],
                                                 "allgather": gathered.get("allgather", 0),
                                                 "averaged": averaged})


def checkpoint_keys(folder: Path) -> list[str]:
    """The keys a distributed checkpoint in ``folder`` holds (none when it is not one)."""
    if not (folder / ".metadata").is_file():
        return []
    return sorted(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def any_rank(failed: bool, info: dist.DistInfo) -> bool:
    """Whether any rank failed (a collective: every rank calls it)."""
    if info.world_size == 1:
        return failed
    flag = torch.tensor([float(failed)], device=info.device)
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)
    return bool(flag.item())


def attempt(name: str, fn: Any, *args: Any) -> Optional[str]:
    """Run one of your functions; the first line of what it raised (reported), or None."""
    try:
        fn(*args)
        return None
    except (Exception, dcp.CheckpointException) as error:   # for the judge to name the mistake
        text = f"{type(error).__name__}: {(str(error).strip() or '-').splitlines()[0]}"
        traceback.print_exc()
        events.emit("metric", name=f"{name}_error", value=text[:300])
        return text


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train and save (``--save DIR``), or load (``--load DIR``); report what the judge reads."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", metavar="DIR", help="train, then save a checkpoint into DIR")
    what.add_argument("--load", metavar="DIR", help="load the checkpoint in DIR")
    args = p.parse_args(argv)
    info = dist.setup(timeout_s=60)
    if info.world_size > 1 and fsdp_problem(info.device):
        raise SystemExit(fsdp_problem(info.device))   # FSDP2 on a CPU needs torch >= 2.7
    torch.manual_seed(0 if args.save else 1)    # loading: other weights until the checkpoint
    model = Transformer().to(info.device)
    num_params = sum(p.numel() for p in model.parameters())
    initial = copy.deepcopy(model)
    if info.world_size > 1:
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        failed = attempt("shard", shard, model, mesh)
        if failed:   # was the root sharded before the block that failed?
            events.emit("metric", name="root_first", value=isinstance(model, FSDPModule))
        if any_rank(bool(failed), info):
            dist.cleanup()
            return
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    events.emit("metric", name="layout", value={
        "num_params": num_params, "world_size": info.world_size, "blocks": BLOCKS,
        "not_sharded": plain,
        "param_bytes": local_bytes(model.parameters()),
        "estimate": bytes_per_rank(num_params, info.world_size)})
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    if args.save:
        train(model, optimizer, info)
        trained = [full(p) for p in model.parameters()]
        if info.is_main:
            losses, alone = one_process(initial, STEPS)
            gap = math.sqrt(sum(float((a - b.detach()).pow(2).sum())
                                for a, b in zip(trained, alone.parameters())))
            moved = math.sqrt(sum(float((b.detach() - c.detach()).pow(2).sum())
                                  for b, c in zip(alone.parameters(), initial.parameters())))
            events.emit("metric", name="one_process", value={"losses": losses,
                                                             "weight_gap": gap / moved})
    action, fn = ("save", save) if args.save else ("load", load)
    failed = attempt(action, fn, model, optimizer, args.save or args.load)
    if not any_rank(bool(failed), info):
        values = digests(model, optimizer)
        if info.is_main:
            events.emit("metric", name="saved" if args.save else "loaded", value=values)
            if args.save:
                folder = Path(args.save)
                names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
                events.emit("metric", name="files", value=names)
                events.emit("metric", name="keys", value=checkpoint_keys(folder))
    dist.cleanup()


if __name__ == "__main__":
    main()
