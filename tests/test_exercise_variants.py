"""Every coding exercise against solutions a class would hand in: for each, at least one that is
right but written differently from ours (it must pass) and two classic mistakes (each must be
rejected with a message that names the mistake). Each variant is the reference solution in
``tests/solutions/`` with a few lines changed, run through the real judge after a real launch
(or, for an exercise of several launches such as 11b's save and loads, a real set of them);
the variants run three at a time, those selected (``-k``) once for the whole module.

The capstone (13) is judged on the notebook's five launches of one job: a variant launches its
file for the runs it names (``runs``) and hands in the reference job's for the others, as a
learner whose job is right but for that mistake would; the reference's five runs are made once
once (four of them in float16, on a CPU too, so that a GradScaler is always judged) and serve
every capstone variant (and the judge as its reference).

A busy machine must not change a verdict: a run that ends by itself gets a launch timeout and a
process-group timeout only as safety nets (minutes); those that hang on purpose are ended by a
timeout that is their point (the deadlock's launch timeout; for 10's two hangs the 3 s group
timeout that the notebook gives the learner's runs), long enough for every rank to reach the
hang first. Where the events a variant's ranks emit say that
each reached its hang (``hang``), the launch ends as that timeout a few seconds later
(``on_event``): the judge reads the same result (status, stacks) as after the clock."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_launch import end_once_said

import ddplab
from ddplab.lab.grading import FSDP2_RUNS  # 11b's launches: save on 2, load on 4 and 1
from ddplab.lab.judges import capstone as capstone_judge

pytestmark = pytest.mark.slow
SOLUTIONS = Path(__file__).resolve().parent / "solutions"


@dataclass(frozen=True)
class Variant:
    name: str
    key: str
    solution: str
    edits: tuple[tuple[str, str], ...]
    right: bool
    words: tuple[str, ...] = ()  # what a rejection must say (any one of each |-separated group)
    absent: tuple[str, ...] = ()  # what it must not say (a wrong diagnosis)
    nprocs: int = 2
    timeout: float = 300   # a safety net: a run that ends by itself never meets it
    args: tuple[str, ...] = ()
    runs: tuple[str, ...] = ("ddp",)  # 13 only: which of the five launches use this file
    launches: tuple[tuple[str, int, tuple[str, ...]], ...] = ()  # named, judged as one set
    hang: tuple[tuple[str, int], ...] = ()  # (event, rank): each rank's last word before it


# 04: the reference's sampler line, and a sampler of the learner's own in its place (rank r
# reads the r-th of world equal blocks of each epoch's shuffled order)
SAMPLER = "    sampler = DistributedSampler(train_set, seed=0, drop_last=True)\n"
OWN_SAMPLER = (
    (SAMPLER, "    sampler = Blocks(len(train_set), dist.get_rank(), dist.get_world_size())\n"),
    ("\n\ndef main() -> None:\n",
     "\n\nclass Blocks:\n"
     "    def __init__(self, n, rank, world):\n"
     "        self.n, self.rank, self.world, self.epoch = n, rank, world, 0\n\n"
     "    def set_epoch(self, epoch):\n        self.epoch = epoch\n\n"
     "    def __len__(self):\n        return self.n // self.world\n\n"
     "    def __iter__(self):\n        import random\n\n"
     "        order = list(range(self.n))\n"
     "        random.Random(1000 + self.epoch).shuffle(order)\n"
     "        return iter(order[self.rank * len(self):(self.rank + 1) * len(self)])\n"
     "\n\ndef main() -> None:\n"),
)
FSDP2_SAVE = ("    model_state, optim_state = get_state_dict(model, optimizer)\n"
              "    dcp.save({\"model\": model_state, \"optim\": optim_state}, "
              "checkpoint_id=path)\n")
FSDP2_LOAD = ("    model_state, optim_state = get_state_dict(model, optimizer)\n"
              "    state = {\"model\": model_state, \"optim\": optim_state}\n"
              "    dcp.load(state, checkpoint_id=path)\n")


# 06: the reference's AMP step, and its clipping lines
UNSCALE = "    scaler.unscale_(optimizer)   # once, after backward: the true gradients\n"
CLIP = "    nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
AMP_STEP = ("    scaler.scale(loss).backward()\n" + UNSCALE + CLIP
            + "    scaler.step(optimizer)       # does not unscale a second time\n"
            "    scaler.update()\n")


VARIANTS = [
    # ----------------------------------------------------------------- 03: the DDP loop
    Variant("03 other style", "03", "ddp_wrap.py", (
        ("    model = model.to(device)  # first to the device, then wrap\n"
         "    model = DDP(model, device_ids=[device.index] if device.type == \"cuda\" else None)\n",
         "    ddp = torch.nn.parallel.DistributedDataParallel(\n"
         "        model.to(device), device_ids=None if device.type == \"cpu\" else [device])\n"
         "    model = ddp\n"),
        ("            optimizer.zero_grad()\n", ""),
        ("            optimizer.step()\n",
         "            optimizer.step()\n            optimizer.zero_grad(set_to_none=True)\n"),
    ), right=True),
    Variant("03 trained the unwrapped model", "03", "ddp_wrap.py", (
        ("    model = DDP(model, device_ids=[device.index] if device.type == \"cuda\" else None)\n"
         "    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)\n",
         "    ddp_model = DDP(model, device_ids=[device.index] if device.type == \"cuda\" "
         "else None)\n"
         "    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)\n"),
    ), right=False, words=("wrapped the model in DDP but trained the unwrapped one",)),
    Variant("03 no DDP at all", "03", "ddp_wrap.py", (
        ("    model = DDP(model, device_ids=[device.index] if device.type == \"cuda\" else None)\n",
         ""),
    ), right=False, words=("different weights", "DistributedDataParallel")),
    # ----------------------------------------------------------------- 03b: no_sync
    Variant("03b no_sync on every micro-batch but the last, by index", "03b", "accumulate.py", (
        ("    optimizer.zero_grad()\n    *first, last = micro_batches\n"
         "    with model.no_sync():  # gradients add up locally, nothing is sent\n"
         "        for inputs, targets in first:\n"
         "            (F.mse_loss(model(inputs), targets) / len(micro_batches)).backward()\n"
         "    inputs, targets = last\n"
         "    (F.mse_loss(model(inputs), targets) / len(micro_batches)).backward()"
         "  # one all-reduce\n",
         "    import contextlib\n    optimizer.zero_grad(set_to_none=True)\n"
         "    k = len(micro_batches)\n"
         "    for i, (inputs, targets) in enumerate(micro_batches):\n"
         "        sync = i == k - 1\n"
         "        with contextlib.nullcontext() if sync else model.no_sync():\n"
         "            loss = F.mse_loss(model(inputs), targets, reduction=\"sum\")\n"
         "            (loss / (k * targets.numel())).backward()\n"),
    ), right=True),
    Variant("03b no no_sync", "03b", "accumulate.py", (
        ("    with model.no_sync():  # gradients add up locally, nothing is sent\n",
         "    if True:\n"),
    ), right=False, words=("4 times per step", "no_sync()")),
    Variant("03b every backward in no_sync", "03b", "accumulate.py", (
        ("    inputs, targets = last\n    (F.mse_loss", "    inputs, targets = last\n"
         "    with model.no_sync():\n        (F.mse_loss"),
    ), right=False, words=("never all-reduced",)),
    Variant("03b the sum of the losses", "03b", "accumulate.py", (
        ("            (F.mse_loss(model(inputs), targets) / len(micro_batches)).backward()\n",
         "            F.mse_loss(model(inputs), targets).backward()\n"),
        ("    (F.mse_loss(model(inputs), targets) / len(micro_batches)).backward()",
         "    F.mse_loss(model(inputs), targets).backward()"),
    ), right=False, words=("mean over the micro-batches",)),
    # ----------------------------------------------------------------- 04: the sampler
    Variant("04 a sampler of its own: blocks of a shuffle seeded with the epoch", "04",
            "sampler.py", OWN_SAMPLER, right=True),
    Variant("04 DistributedSampler's padding", "04", "sampler.py", (
        (SAMPLER, "    sampler = DistributedSampler(train_set, seed=0)\n"),
    ), right=False, words=("read twice", "padding")),
    Variant("04 a sampler of its own that cuts the tail before the shuffle", "04", "sampler.py", (
        *OWN_SAMPLER,
        ("        order = list(range(self.n))\n",
         "        order = list(range(len(self) * self.world))   # the mistake: a fixed tail\n"),
    ), right=False, words=("left out in every epoch", "shuffled order")),
    # ----------------------------------------------------------------- 05: checkpoints
    Variant("05 map_location cpu, other style", "05", "checkpoint.py", (
        ("    if rank == 0:\n        write_file(state, path)\n",
         "    if dist.get_rank() == 0:\n        write_file(state, path)\n"),
        ("map_location=device, ", "map_location=\"cpu\", "),
        ("    if not os.path.exists(path):\n        return 0\n    state = load(path, device)\n",
         "    try:\n        state = load(path, device)\n    except FileNotFoundError:\n"
         "        return 0\n"),
    ), right=True),
    Variant("05 barrier inside if rank == 0", "05", "checkpoint.py", (
        ("        write_file(state, path)\n    dist.barrier()",
         "        write_file(state, path)\n        dist.barrier()"),
    ), right=False, words=("deadlock", "barrier"), timeout=60,  # as the notebook: ends the hang
        hang=(("wrote", 0), ("loaded", 1))),  # rank 0 then waits in save, rank 1 in backward
    Variant("05 no barrier after the save (notebook 05's break-it step)", "05", "checkpoint.py", (
        ("    dist.barrier()  # nobody goes on", "    pass  # nobody goes on"),
    ), right=False, words=("read too early", "while rank 0 was still writing")),
    Variant("05 no map_location", "05", "checkpoint.py", (
        ("map_location=device, ", ""),
    ), right=False, words=("saved on a GPU", "the device it is given")),
    Variant("05 resume forgets the optimizer", "05", "checkpoint.py", (
        ("    optimizer.load_state_dict(state[\"optimizer\"])\n", ""),
    ), right=False, words=("not the optimizer", "momentum")),
    Variant("05 torch.save instead of write_file", "05", "checkpoint.py", (
        ("    if rank == 0:\n        write_file(state, path)\n",
         "    if rank == 0:\n        torch.save(state, path)\n"),
    ), right=False, words=("not with write_file",)),
    # ----------------------------------------------------------------- 06: AMP
    Variant("06 other style", "06", "amp.py", (
        ("    return torch.float16 if device.type == \"cuda\" else torch.bfloat16",
         "    if device.type == \"cpu\":\n        return torch.bfloat16\n    return torch.float16"),
        ("    return torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)",
         "    use = amp_dtype is torch.float16\n"
         "    return torch.amp.GradScaler(device=device.type, enabled=use)"),
        ("    with torch.autocast(inputs.device.type, dtype=amp_dtype):\n"
         "        loss = F.cross_entropy(model(inputs), labels)\n",
         "    with torch.autocast(device_type=inputs.device.type, dtype=amp_dtype):\n"
         "        output = model(inputs)\n        loss = F.cross_entropy(output, labels)\n"),
        (CLIP, "    torch.nn.utils.clip_grad_norm_(\n"
               "        [p for p in model.parameters() if p.grad is not None], max_norm)\n"),
    ), right=True),
    Variant("06 no GradScaler", "06", "amp.py", (
        ("    return torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)",
         "    return None"),
        (AMP_STEP, "    loss.backward()\n" + CLIP + "    optimizer.step()\n"),
    ), right=False, words=("not a torch.amp.GradScaler",)),
    Variant("06 scaler built but bypassed", "06", "amp.py", (
        (AMP_STEP, "    loss.backward()\n" + CLIP + "    optimizer.step()\n"),
    ), right=False, words=("scale() 0 times", "step() 0 times")),
    Variant("06 clipped before unscale_", "06", "amp.py", (
        (UNSCALE + CLIP, CLIP),
    ), right=False, words=("the clip saw the scaled gradients", "true gradients")),
    Variant("06 unscale_ twice", "06", "amp.py", (
        (CLIP, CLIP + UNSCALE),
    ), right=False, words=("unscale_(optimizer) twice",)),
    Variant("06 clipped after the step", "06", "amp.py", (
        (UNSCALE + CLIP + "    scaler.step(optimizer)       # does not unscale a second time\n",
         "    scaler.step(optimizer)\n" + CLIP),
    ), right=False, words=("clipped after scaler.step()",)),
    Variant("06 backward under autocast, loss outside", "06", "amp.py", (
        ("    with torch.autocast(inputs.device.type, dtype=amp_dtype):\n"
         "        loss = F.cross_entropy(model(inputs), labels)\n",
         "    with torch.autocast(inputs.device.type, dtype=amp_dtype):\n"
         "        output = model(inputs)\n    loss = F.cross_entropy(output, labels)\n"),
    ), right=False, words=("the loss is bfloat16|the loss is float16",)),
    # ----------------------------------------------------------------- 08: collectives
    Variant("08 blocking send and recv by parity, in-place mean", "08", "collective.py", (
        ("    torch_dist.all_reduce(tensor)  # SUM, in place\n"
         "    return tensor / torch_dist.get_world_size()",
         "    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)\n"
         "    tensor /= torch_dist.get_world_size()\n    return tensor"),
        ("    requests = [torch_dist.isend(tensor, dst=(rank + 1) % world_size),\n"
         "                torch_dist.irecv(received, src=(rank - 1) % world_size)]\n"
         "    for request in requests:\n        request.wait()\n",
         "    right, left = (rank + 1) % world_size, (rank - 1) % world_size\n"
         "    if rank % 2 == 0:\n        torch_dist.send(tensor, dst=right)\n"
         "        torch_dist.recv(received, src=left)\n    else:\n"
         "        torch_dist.recv(received, src=left)\n"
         "        torch_dist.send(tensor, dst=right)\n"),
    ), right=True, nprocs=4),
    Variant("08 the sum, not the mean", "08", "collective.py", (
        ("    return tensor / torch_dist.get_world_size()", "    return tensor"),
    ), right=False, words=("the sum over ranks", "times the mean"),
        absent=("get_world_size", "all_reduce"), nprocs=4),
    Variant("08 the ring turns the wrong way", "08", "collective.py", (
        ("torch_dist.isend(tensor, dst=(rank + 1) % world_size)",
         "torch_dist.isend(tensor, dst=(rank - 1) % world_size)"),
        ("torch_dist.irecv(received, src=(rank - 1) % world_size)",
         "torch_dist.irecv(received, src=(rank + 1) % world_size)"),
    ), right=False, words=("right neighbour", "other way"), nprocs=4),
    # ----------------------------------------------------------------- 10: Join
    # The reference joins the loss log (a Joinable of its own); the loss summed once after the
    # loop, and the ranks agreeing on a step count first (zero-loss steps), are right too.
    Variant("10 the loss summed once, after the loop", "10", "uneven_join.py", (
        ("    running = RunningLoss(next(model.parameters()).device)\n"
         "    with Join([model, running]):", "    with Join([model]):"),
        ("            running.add(loss)  # the log: every rank's loss of this step\n"
         "            total = running.total\n"
         "            dist.print0(f\"step {len(losses)}: mean loss so far "
         "{float(total[0] / total[1]):.4f}\")\n"
         "    return losses, float(running.total[0] / running.total[1])\n",
         "    total = torch.tensor([sum(losses), len(losses)], dtype=torch.float64)\n"
         "    torch_dist.all_reduce(total)  # once, on every rank\n"
         "    return losses, float(total[0] / total[1])\n"),
    ), right=True, args=("--pg-timeout", "120")),   # a safety net
    Variant("10 the ranks agree on a step count, zero-loss steps after the last batch", "10",
            "uneven_join.py", (
        ("    running = RunningLoss(next(model.parameters()).device)\n"
         "    with Join([model, running]):  # a rank out of batches answers DDP's and the log's "
         "collectives\n"
         "        for inputs, targets in batches:\n"
         "            loss = F.mse_loss(model(inputs), targets)\n",
         "    total = torch.zeros(2)\n"
         "    most = torch.tensor([len(batches)])\n"
         "    torch_dist.all_reduce(most, op=torch_dist.ReduceOp.MAX)\n"
         "    if True:\n"
         "        for step in range(int(most)):\n"
         "            real = step < len(batches)\n"
         "            inputs, targets = batches[min(step, len(batches) - 1)]\n"
         "            loss = F.mse_loss(model(inputs), targets) * float(real)\n"),
        ("            losses.append(loss.item())\n"
         "            running.add(loss)  # the log: every rank's loss of this step\n"
         "            total = running.total\n",
         "            if real:\n                losses.append(loss.item())\n"
         "            both = torch.stack([loss.detach(), torch.tensor(float(real))])\n"
         "            torch_dist.all_reduce(both)\n"
         "            total += both\n"),
        ("    return losses, float(running.total[0] / running.total[1])\n",
         "    return losses, float(total[0] / total[1])\n"),
    ), right=True, args=("--pg-timeout", "120")),
    Variant("10 no Join", "10", "uneven_join.py", (
        ("    with Join([model, running]):", "    if True:"),
    ), right=False, words=("timed out", "left the loop"),
        args=("--pg-timeout", "3")),  # the hang: its end
    Variant("10 Join([model]) alone", "10", "uneven_join.py", (
        ("    with Join([model, running]):", "    with Join([model]):"),
    ), right=False, words=("Join([model]) shadows only DDP's collectives",
                           "your loss all_reduce is still waiting on the rank that finished"),
        args=("--pg-timeout", "3")),  # the hang: its end
    Variant("10 every rank stops at the shortest shard", "10", "uneven_join.py", (
        ("        for inputs, targets in batches:\n",
         "        shortest = torch.tensor(len(batches))\n"
         "        torch_dist.all_reduce(shortest, op=torch_dist.ReduceOp.MIN)\n"
         "        for inputs, targets in batches[:int(shortest)]:\n"),
    ), right=False, words=("trained on 4 batches but has 5", "all of its own batches"),
        args=("--pg-timeout", "120")),   # it ends by itself: a safety net
    Variant("10 Join that throws once a rank runs out", "10", "uneven_join.py", (
        ("    with Join([model, running]):",
         "    with Join([model, running], throw_on_early_termination=True):"),
    ), right=False, words=("raised on some ranks", "every batch trained"),
        args=("--pg-timeout", "120")),   # it ends by itself: a safety net
    Variant("10 each rank's mean of its own losses", "10", "uneven_join.py", (
        ("    return losses, float(running.total[0] / running.total[1])\n",
         "    return losses, sum(losses) / len(losses)\n"),
    ), right=False, words=("mean loss train() returned is wrong", "each batch of each rank once"),
        args=("--pg-timeout", "120")),
    Variant("10 each rank pads its shard by repeating its last batch", "10", "uneven_join.py", (
        ("    with Join([model, running]):", "    if True:"),
        ("        for inputs, targets in batches:\n",
         "        most = torch.tensor(len(batches))\n"
         "        torch_dist.all_reduce(most, op=torch_dist.ReduceOp.MAX)\n"
         "        batches = batches + batches[-1:] * (int(most) - len(batches))\n"
         "        for inputs, targets in batches:\n"),
    ), right=False, words=("its batch 4 twice", "each of its own batches once"),
        absent=("skip", "stop early"), args=("--pg-timeout", "120")),   # a safety net
    # ----------------------------------------------------------------- 11: pipeline
    Variant("11 non-blocking messages, and the loss summed then divided", "11",
            "pipeline_forward.py", (
        ("            torch_dist.recv(x, src=0)\n",
         "            torch_dist.irecv(x, src=0).wait()\n"),
        ("            torch_dist.send(y.detach(), dst=1)\n",
         "            torch_dist.isend(y.detach(), dst=1).wait()\n"),
        ("            weight = len(micro_targets[micro]) / sum(len(t) for t in micro_targets)\n"
         "            (F.cross_entropy(output, micro_targets[micro]) * weight).backward()\n",
         "            total = sum(len(t) for t in micro_targets)\n"
         "            (F.cross_entropy(output, micro_targets[micro], reduction=\"sum\") / total"
         ").backward()\n"),
    ), right=True),
    Variant("11 the received activation is not tracked by autograd", "11",
            "pipeline_forward.py", (
        ("            x.requires_grad_()          # so that backward computes d loss / d x, "
         "for rank 0\n", ""),
    ), right=False, words=("does not track", "no gradient to send back")),
    Variant("11 the micro-batches' mean losses not weighted", "11", "pipeline_forward.py", (
        ("            (F.cross_entropy(output, micro_targets[micro]) * weight).backward()\n",
         "            F.cross_entropy(output, micro_targets[micro]).backward()\n"),
    ), right=False, words=("sum of the 4", "share of the batch")),
    Variant("11 rank 0 waits for each gradient right after its send (deadlock)", "11",
            "pipeline_forward.py", (
        ("            torch_dist.send(y.detach(), dst=1)\n",
         "            torch_dist.send(y.detach(), dst=1)\n"
         "            torch_dist.recv(torch.empty_like(y), src=1)\n"),
    ), right=False, words=("deadlock", "rank 0 in forward and rank 1 in forward"),
        args=("--pg-timeout", "3")),  # the hang: its end
    # ----------------------------------------------------------------- 12: the TP plan
    Variant("12 one style for both ends of the block, heads read from the weight", "12",
            "tp_plan.py", (
        ("    n = mesh.size()\n    block.attention.n_heads = N_HEADS // n"
         "      # each rank holds, and views, its heads only\n", ""),
        ("    parallelize_module(block, mesh, PrepareModuleInput(\n"
         "        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), "
         "use_local_output=True))\n"
         "    parallelize_module(block, mesh, PrepareModuleOutput(\n"
         "        output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)))\n",
         "    from torch.distributed.tensor.parallel import PrepareModuleInputOutput as Both\n"
         "    parallelize_module(block, mesh, Both(input_layouts=Replicate(), use_local_input=True,"
         "\n        desired_input_layouts=Shard(1), output_layouts=Shard(1),"
         "\n        desired_output_layouts=Replicate()))\n"
         "    attention = block.attention\n"
         "    attention.n_heads = attention.wq.weight.to_local().size(0) // attention.head_dim\n"),
    ), right=True),
    Variant("12 the course's plan (shown in notebook 12 once the learner's is right)", "12",
            "tp_plan.py", (
        ("    n = mesh.size()\n",
         "    from ddplab.lab.answers.tensor_parallel import llama_plan\n"
         "    return llama_plan(block, mesh)\n    n = mesh.size()\n"),
    ), right=True),
    Variant("12 hard-coded head count", "12", "tp_plan.py", (
        ("    block.attention.n_heads = N_HEADS // n"
         "      # each rank holds, and views, its heads only\n", ""),
    ), right=False, words=("hard-coded head count",)),
    Variant("12 SequenceParallel without the block's input layout", "12", "tp_plan.py", (
        ("    parallelize_module(block, mesh, PrepareModuleInput(\n"
         "        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), "
         "use_local_output=True))\n", ""),
    ), right=False, words=("forgets the input layout", "must be declared")),
    Variant("12 no PrepareModuleInput before attention and feed_forward", "12", "tp_plan.py", (
        ("        \"attention\": sequence_in,", ""),
        ("        \"feed_forward\": sequence_in,\n", ""),
    ), right=False, words=("communicates too much", "once per sub-block")),
    Variant("12 tensor parallel without sequence parallel", "12", "tp_plan.py", (
        ("        \"attention_norm\": SequenceParallel(),\n", ""),
        ("        \"ffn_norm\": SequenceParallel(),\n", ""),
        ("        \"attention\": sequence_in,", ""),
        ("        \"feed_forward\": sequence_in,\n", ""),
        ("RowwiseParallel(output_layouts=Shard(1))", "RowwiseParallel()"),
        ("    parallelize_module(block, mesh, PrepareModuleInput(\n"
         "        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), "
         "use_local_output=True))\n"
         "    parallelize_module(block, mesh, PrepareModuleOutput(\n"
         "        output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)))\n", ""),
    ), right=False, words=("not sequence-parallel",)),
    Variant("12 w2 column-wise", "12", "tp_plan.py", (
        ("        \"feed_forward.w2\": RowwiseParallel(output_layouts=Shard(1)),",
         "        \"feed_forward.w2\": ColwiseParallel(),"),
    ), right=False, words=("feed_forward.w2 is column-wise", "row-wise")),
    Variant("12 wo's output left Replicate where the residual is Shard(1)", "12", "tp_plan.py", (
        ("\"attention.wo\": RowwiseParallel(output_layouts=Shard(1))",
         "\"attention.wo\": RowwiseParallel()"),
    ), right=False, words=("attention returned Replicate()", "needed Shard(1)",
                           "attention.wo", "the residual's layout"),
        absent=("a DTensor and a plain tensor", "output_layouts=")),
]

# ----------------------------------------------------------------- 13: the capstone
# Its classic mistakes are small edits of the reference job (ddplab/workers/capstone.py),
# launched as notebook 13 launches the job (its judge's LAUNCHES).
CAPSTONE = "../../ddplab/workers/capstone.py"   # from tests/solutions/
FIVE = capstone_judge.RUNS
# The launches' own arguments (four runs in float16, a GradScaler on a CPU too) for every variant;
# in bfloat16 the reference's ddp run alone (not a variant of its own), for a mistake that a
# GradScaler all but hides: the leaked gradient is unscaled with the new one (1/65536 of it).
BFLOAT16 = ("--amp-dtype", "bfloat16")
CAPSTONE_REFERENCES = {(): Variant("13 the reference job", "13", CAPSTONE, (), right=True,
                                   runs=FIVE),
                       BFLOAT16: Variant("13 the reference job's ddp run in bfloat16", "13",
                                         CAPSTONE, (), right=True, args=BFLOAT16)}
VARIANTS += [
    CAPSTONE_REFERENCES[()],
    Variant("13 a Stateful app state, a skipping sampler, LambdaLR", "13", "capstone.py", (),
            right=True, runs=FIVE),
    Variant("13 every rank prints a line per epoch", "13", CAPSTONE, (
        ("        sampler.set_epoch(epoch)  # a new order every epoch, the same after a resume\n",
         "        sampler.set_epoch(epoch)\n"
         "        print(f\"rank {rank}: epoch {epoch} starts at step {step}\", flush=True)\n"),
    ), right=True),
    Variant("13 dcp.async_save on a group of its own, waited for", "13", CAPSTONE, (
        ("    model_state, optimizer_state = get_state_dict(model, optimizer)\n    dcp.save(",
         "    global PENDING, GROUP\n"
         "    if PENDING is not None:\n"
         "        PENDING.result()   # the previous save is whole before the next begins\n"
         "    GROUP = GROUP or dist.new_group(backend=\"gloo\")   # not the training's group\n"
         "    model_state, optimizer_state = get_state_dict(model, optimizer)\n"
         "    PENDING = dcp.async_save(process_group=GROUP, state_dict="),
        ("def resume(folder", "PENDING = GROUP = None\n\n\ndef resume(folder"),
        ("    # [/loop]\n",
         "    # [/loop]\n    if PENDING is not None:\n        PENDING.result()\n"),
    ), right=True),
    Variant("13 a sampler seeded with seed + rank", "13", CAPSTONE, (
        ("seed=args.seed)", "seed=args.seed + rank)"),
    ), right=False, words=("same seed", "seed + rank")),
    Variant("13 drop_last in the sampler", "13", CAPSTONE, (
        ("seed=args.seed)", "seed=args.seed, drop_last=True)"),
    ), right=False, words=("drop_last",), absent=("more than one rank",)),
    Variant("13 drop_last in the sampler and the loader", "13", CAPSTONE, (
        ("seed=args.seed)", "seed=args.seed, drop_last=True)"),
        ("sampler=sampler)", "sampler=sampler, drop_last=True)"),
    ), right=False, words=("drop_last", "22 an epoch"), absent=("more than one rank",)),
    Variant("13 one checkpoint folder, overwritten", "13", CAPSTONE, (
        ('checkpoint_id=os.path.join(folder, f"step-{step}"))',
         'checkpoint_id=os.path.join(folder, "step-0"))'),
    ), right=False, words=("again", "a folder of its own")),
    Variant("13 rank 0 scores its half of the test set", "13", CAPSTONE, (
        ("DataLoader(test_set, batch_size=512)", "DataLoader(test_set, batch_size=512, "
         "sampler=DistributedSampler(test_set, num_replicas=2, rank=0, shuffle=False))"),
    ), right=False, words=("rank 0 scored", "the whole test set")),
    Variant("13 the loss divided by the world size", "13", CAPSTONE, (
        ("loss = F.cross_entropy(model(inputs), labels)",
         "loss = F.cross_entropy(model(inputs), labels) / world"),
    ), right=False, words=("divide the loss by the world size",)),
    Variant("13 no zero_grad", "13", CAPSTONE, (
        ("            optimizer.zero_grad()\n", ""),
    ), right=False, words=("the ddp run", "still in it"), args=BFLOAT16),
    Variant("13 no set_epoch", "13", CAPSTONE, (
        ("        sampler.set_epoch(epoch)", "        pass"),
    ), right=False, words=("same order in every epoch", "another order every epoch")),
    Variant("13 torch.save on every rank", "13", CAPSTONE, (
        ("    dcp.save({", "    torch.save({"),
        ('checkpoint_id=os.path.join(folder, f"step-{step}"))',
         'os.path.join(folder, "last.pt"))'),
    ), right=False, words=("as big as rank 0's", "only rank 0 writes")),
    Variant("13 evaluation through the wrapper on rank 0", "13", CAPSTONE, (
        ("    net = build_model(args)\n    net.load_state_dict(full)\n"
         "    net.to(device).eval()\n", "    net = model.eval()\n"),
    ), right=False, words=("DDP-wrapped model on rank 0 alone",)),
    Variant("13 FSDP2 evaluated on rank 0 alone (a hang after the first launch)", "13",
            CAPSTONE, (
        ("    full = get_model_state_dict(", "    if args.strategy == \"fsdp\" and rank == 0:\n"
         "        return score(model.eval(), test_set, device)   # the mistake: rank 0 alone\n"
         "    if args.strategy == \"fsdp\":\n        return None\n"
         "    full = get_model_state_dict("),
        ("def main() -> None:", "def score(net, test_set, device):\n    correct = 0\n"
         "    with torch.no_grad():\n"
         "        for inputs, labels in DataLoader(test_set, batch_size=512):\n"
         "            correct += int((net(inputs.to(device)).argmax(1) == labels.to(device)).sum())\n"
         "    return correct / len(test_set)\n\n\ndef main() -> None:"),
    ), right=False, words=("the fsdp run", "deadlock", "rank 1 never arrives"),
        runs=("ddp", "fsdp")),
    Variant("13 fully_shard around the root alone", "13", CAPSTONE, (
        ("            fully_shard(block)\n", "            pass\n"),
    ), right=False, words=("made 1 unit(s)", "each block"), runs=("fsdp",)),
    Variant("13 the resume loads the model alone", "13", CAPSTONE, (
        ('    state = {"model": model_state, "optimizer": optimizer_state,\n',
         '    state = {"model": model_state,\n'),
        ('optim_state_dict=state["optimizer"]', "optim_state_dict=optimizer_state"),
    ), right=False, words=("not the optimizer's state",), runs=("killed", "resumed")),
    Variant("13 the resume leaves the GradScaler out", "13", CAPSTONE, (
        ('    if state["scaler"]:\n        scaler.load_state_dict(state["scaler"])\n', ""),
    ), right=False, words=("not the GradScaler", "holds the scaler too"),
        runs=("killed", "resumed")),
    Variant("13 float16 without a GradScaler", "13", CAPSTONE, (
        ("            scaler.scale(loss).backward()\n            scaler.step(optimizer)\n"
         "            scaler.update()\n",
         "            loss.backward()\n            optimizer.step()\n"),
    ), right=False, words=("float16 needs a GradScaler",), runs=("ddp",)),
    Variant("13 FSDP2 with a MixedPrecisionPolicy instead of autocast", "13", CAPSTONE, (
        ("    from torch.distributed.fsdp import fully_shard  # public since torch 2.6, the "
         "floor\n", "    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n\n"
         "    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
         "reduce_dtype=torch.float32)\n"),
        ("            fully_shard(block)\n", "            fully_shard(block, mp_policy=policy)\n"),
        ("    return fully_shard(model)\n", "    return fully_shard(model, mp_policy=policy)\n"),
        ("with torch.autocast(device.type, dtype=amp_dtype):",
         "with torch.autocast(device.type, dtype=amp_dtype, enabled=args.strategy == \"ddp\"):"),
    ), right=False, words=("MixedPrecisionPolicy", "inputs", "torch.autocast"),
        absent=("other samples or another LR",), runs=("fsdp",)),
    Variant("13 FSDP2 without autocast", "13", CAPSTONE, (
        ("with torch.autocast(device.type, dtype=amp_dtype):",
         "with torch.autocast(device.type, dtype=amp_dtype, enabled=args.strategy == \"ddp\"):"),
    ), right=False, words=("the fsdp run", "autocast [None]", "with FSDP2 too"), runs=("fsdp",)),
    Variant("13 the loss logged as the mean over the ranks", "13", CAPSTONE, (
        ("            log_step(step, loss.item())\n",
         "            mean = loss.detach().clone()\n            dist.all_reduce(mean)\n"
         "            log_step(step, mean.item() / world)\n"),
    ), right=False, words=("the mean of the ranks' own losses", "its own loss")),
    Variant("13 a save one step late", "13", CAPSTONE, (
        ("            if step % args.save_every == 0:",
         "            if step % args.save_every == 1:"),
    ), right=False, words=("saved no checkpoint after step 23", "after steps 0, 8, 16",
                           "after steps 7, 15, 23"),
        absent=("not complete",), runs=("killed", "resumed")),
    Variant("13 the saved step numbered off by one", "13", CAPSTONE, (
        ('{"step": step, "epoch": epoch,', '{"step": step - 1, "epoch": epoch,'),
    ), right=False, words=("off by 1", "step-24"), absent=("not complete",),
        runs=("killed", "resumed")),
    Variant("13 a sampler re-seeded on resume", "13", CAPSTONE, (
        ('    step = first = progress["step"]',
         '    sampler.seed = args.seed + progress["step"]   # the mistake: a new seed on resume\n'
         '    step = first = progress["step"]'),
    ), right=False, words=("another order", "same seed"), absent=("skips the batches done",),
        runs=("killed", "resumed")),
    Variant("13 the resume takes the newest folder, complete or not", "13", CAPSTONE, (
        ('os.path.exists(os.path.join(folder, name, ".metadata"))',
         "os.path.isdir(os.path.join(folder, name))"),
    ), right=False, words=("the resumed run", "without DCP's .metadata",
                           "newest complete checkpoint"), runs=("killed", "resumed")),
    Variant("13 a rank 0 save without a barrier", "13", CAPSTONE, (
        ("    model_state, optimizer_state = get_state_dict(model, optimizer)\n    dcp.save(",
         "    if dist.get_rank() == 0:  # the mistake: nobody waits for the file\n"
         "        torch.save(model.module.state_dict(), os.path.join(folder, f'step-{step}.pt'))\n"
         "    return\n    dcp.save("),
    ), right=False, words=("while rank 0 was still writing the checkpoint", "barrier"),
        runs=("killed",)),
    Variant("13 a torch.load without map_location", "13", CAPSTONE, (
        ("    model_state, optimizer_state = get_state_dict(model, optimizer)\n    dcp.save(",
         "    if dist.get_rank() == 0:\n"
         "        torch.save(model.module.state_dict(), os.path.join(folder, 'model.pt'))\n"
         "    dist.barrier()\n"
         "    model_state, optimizer_state = get_state_dict(model, optimizer)\n    dcp.save("),
        ("    if name is None:\n        return None\n",
         "    if name is None:\n        return None\n"
         "    torch.load(os.path.join(folder, 'model.pt'))  # the mistake\n"),
    ), right=False, words=("no map_location", "resumed run"), runs=("killed", "resumed")),
    Variant("13 dcp.save on rank 0 alone", "13", CAPSTONE, (
        ("                save(args.checkpoint_dir,",
         "                rank == 0 and save(args.checkpoint_dir,"),
    ), right=False, words=("deadlock", "at line"), timeout=60),  # as the notebook: ends the hang
    # ----------------------------------------------------------------- 11b: FSDP2 and DCP
    Variant("11b modules by type, ceil of the share, DCP through a Stateful", "11b", "fsdp2.py", (
        ("    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
         "reduce_dtype=torch.float32)\n    for block in model.blocks:",
         "    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)\n"
         "    for block in [m for m in model.modules() if isinstance(m, Block)]:"),
        ("    return 16 * num_params // world_size",
         "    return (4 + 4 + 4 + 4) * math.ceil(num_params / world_size)"),
        (FSDP2_SAVE, "    dcp.save({\"app\": App(model, optimizer)}, checkpoint_id=path)\n"),
        (FSDP2_LOAD + "    set_state_dict(model, optimizer, model_state_dict=state[\"model\"],\n"
         "                   optim_state_dict=state[\"optim\"])\n",
         "    dcp.load({\"app\": App(model, optimizer)}, checkpoint_id=path)\n\n\n"
         "from torch.distributed.checkpoint.stateful import Stateful\n\n\n"
         "class App(Stateful):\n"
         "    def __init__(self, model, optimizer):\n"
         "        self.model, self.optimizer = model, optimizer\n\n"
         "    def state_dict(self):\n"
         "        model_state, optim_state = get_state_dict(self.model, self.optimizer)\n"
         "        return {\"model\": model_state, \"optim\": optim_state}\n\n"
         "    def load_state_dict(self, state):\n"
         "        set_state_dict(self.model, self.optimizer, model_state_dict=state[\"model\"],\n"
         "                       optim_state_dict=state[\"optim\"])\n"),
    ), right=True, launches=FSDP2_RUNS),
    Variant("11b the root only", "11b", "fsdp2.py", (
        ("    for block in model.blocks:", "    for block in []:"),
    ), right=False, words=("no per-block sharding", "one all-gather|at once"), launches=FSDP2_RUNS),
    Variant("11b the blocks only", "11b", "fsdp2.py", (
        ("    fully_shard(model, mesh=mesh, mp_policy=policy)   # last: what no block took\n", ""),
    ), right=False, words=("not sharded", "every parameter a shard"), launches=FSDP2_RUNS),
    Variant("11b the root first", "11b", "fsdp2.py", (
        ("    for block in model.blocks:                  # one all-gather per block, each in its "
         "turn\n        fully_shard(block, mesh=mesh, mp_policy=policy)\n"
         "    fully_shard(model, mesh=mesh, mp_policy=policy)   # last: what no block took\n",
         "    fully_shard(model, mesh=mesh, mp_policy=policy)\n"
         "    for block in model.blocks:\n"
         "        fully_shard(block, mesh=mesh, mp_policy=policy)\n"),
    ), right=False, words=("Wrong wrapping order", "sharded once"), launches=FSDP2_RUNS),
    Variant("11b torch.save of each rank's sharded state dict", "11b", "fsdp2.py", (
        (FSDP2_SAVE, "    import os\n    os.makedirs(path, exist_ok=True)\n"
         "    torch.save({\"model\": model.state_dict(), \"optim\": optimizer.state_dict()},\n"
         "               f\"{path}/rank{torch_dist.get_rank()}.pt\")\n"),
        (FSDP2_LOAD, "    rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0\n"
         "    state = torch.load(f\"{path}/rank{rank}.pt\", weights_only=False)\n"),
    ), right=False, words=("not a distributed checkpoint", "torch.save"), launches=FSDP2_RUNS),
    Variant("11b DCP loads into the local shards", "11b", "fsdp2.py", (
        (FSDP2_LOAD, FSDP2_LOAD.replace(
            "    dcp.load(", "    local = {k: (v.to_local() if hasattr(v, \"to_local\") else v)\n"
            "             for k, v in state[\"model\"].items()}\n    state[\"model\"] = local\n"
            "    dcp.load(")),
    ), right=False, words=("another world size done the wrong way|weights differ",),
        launches=FSDP2_RUNS),
    Variant("11b the optimizer left out of the checkpoint", "11b", "fsdp2.py", (
        (FSDP2_SAVE, "    dcp.save({\"model\": get_state_dict(model, optimizer)[0]}, "
         "checkpoint_id=path)\n"),
        (FSDP2_LOAD + "    set_state_dict(model, optimizer, model_state_dict=state[\"model\"],\n"
         "                   optim_state_dict=state[\"optim\"])\n",
         "    state = {\"model\": get_state_dict(model, optimizer)[0]}\n"
         "    dcp.load(state, checkpoint_id=path)\n"
         "    model.load_state_dict(state[\"model\"])\n"),
    ), right=False, words=("not Adam's state",), launches=FSDP2_RUNS),
    # Judged on the save launch alone: the mistake shows there (the loads would find none).
    Variant("11b no reduce_dtype: the gradients averaged in bfloat16", "11b", "fsdp2.py", (
        ("MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
         "MixedPrecisionPolicy(param_dtype=torch.bfloat16)"),
    ), right=False, words=("averaged over the ranks in bfloat16", "average in float32"),
        absent=("training is right", "reduce_dtype="), launches=FSDP2_RUNS[:1]),
    Variant("11b DCP of the optimizer's own state_dict(), empty in a fresh one", "11b",
            "fsdp2.py", (
        (FSDP2_SAVE, "    dcp.save({\"model\": model.state_dict(),\n"
         "              \"optim\": optimizer.state_dict()}, checkpoint_id=path)\n"),
        (FSDP2_LOAD + "    set_state_dict(model, optimizer, model_state_dict=state[\"model\"],\n"
         "                   optim_state_dict=state[\"optim\"])\n",
         "    state = {\"model\": model.state_dict(), \"optim\": optimizer.state_dict()}\n"
         "    dcp.load(state, checkpoint_id=path)\n"
         "    model.load_state_dict(state[\"model\"])\n"
         "    optimizer.load_state_dict(state[\"optim\"])\n"),
    ), right=False, words=("empty", "get_state_dict", "set_state_dict"),
        absent=("save and load the optimizer too",), launches=FSDP2_RUNS),
]


def write(variant: Variant, folder: Path) -> Path:
    text = (SOLUTIONS / variant.solution).read_text()
    for old, new in variant.edits:
        assert old in text, f"{variant.name}: {old!r} is not in {variant.solution} any more"
        text = text.replace(old, new)
    path = folder / variant.name.replace(" ", "_").replace(",", "") / Path(variant.solution).name
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def capstone_runs(variant: Variant, folder: Path) -> dict[str, object]:
    """The launches of the variant's job it names, in the notebook's order (the resumed and the
    resharded runs go on from copies of the killed run's folder)."""
    path = write(variant, folder)
    return capstone_judge.launch_runs(   # after a ddp run, a hang ends once certain (watch)
        lambda nprocs, args, **watch: ddplab.launch(
            str(path), nprocs, quiet=True, live=False,
            timeout=min(variant.timeout, watch.get("timeout", variant.timeout)),
            on_event=watch.get("on_event"), args=[*args, *variant.args],
            env={"TMPDIR": str(folder)}),  # (its markers)
        path.parent, variant.runs)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory, request) -> dict[str, object]:
    """The verdict on every variant this session runs (``-k`` picks them)."""
    folder = tmp_path_factory.mktemp("variants")
    chosen = {item.callspec.params["variant"].name for item in request.session.items
              if getattr(item, "module", None) is request.module and hasattr(item, "callspec")}

    def launch(variant: Variant, path: Path, nprocs: int, args: list[str]):
        return ddplab.launch(str(path), nprocs, quiet=True, live=False,
                             timeout=variant.timeout, args=args, env={"TMPDIR": str(folder)},
                             on_event=end_once_said(*variant.hang, after=5.0)
                             if variant.hang else None)

    def judged(variant: Variant):
        if variant.key == "13":   # against the reference's runs with the same arguments
            base = references[variant.args].result()
            mine = (base if variant is CAPSTONE_REFERENCES[variant.args] else
                    capstone_runs(variant, folder))
            return ddplab.check("13", {**base, **mine, "reference": base["ddp"]})
        path = write(variant, folder)
        if not variant.launches:
            return ddplab.check(variant.key, launch(variant, path, variant.nprocs,
                                                    list(variant.args)))
        where = str(path.parent / "checkpoint")
        return ddplab.check(variant.key, {name: launch(variant, path, nprocs, [
            a.replace("{dir}", where) for a in args]) for name, nprocs, args in variant.launches})

    mine = [v for v in VARIANTS if v.name in chosen]
    with ThreadPoolExecutor(max_workers=3) as pool:
        references = {args: pool.submit(capstone_runs, CAPSTONE_REFERENCES[args], folder)
                      for args in dict.fromkeys(v.args for v in mine if v.key == "13")}
        # first in line: the other 13s compare with them
        return dict(zip([v.name for v in mine], pool.map(judged, mine)))


def test_every_exercise_has_a_right_variant_and_two_wrong_ones():
    keys = {v.key for v in VARIANTS}
    assert keys == {"03", "03b", "04", "05", "06", "08", "10", "11", "11b", "12", "13"}
    for key in keys:
        mine = [v for v in VARIANTS if v.key == key]
        assert sum(v.right for v in mine) >= 1 and sum(not v.right for v in mine) >= 2


# A safety net: every launch of the module (about 60, three at a time) runs in the first test's
# setup, which takes minutes on a busy 2-core machine.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_variant_is_judged_as_a_teacher_would(variant, verdicts):
    verdict = verdicts[variant.name]
    assert bool(verdict) is variant.right, verdict.message
    for group in variant.words:
        assert any(word in verdict.message for word in group.split("|")), (
            f"{group!r} not in: {verdict.message}")
    for words in variant.absent:
        assert words not in verdict.message, verdict.message
