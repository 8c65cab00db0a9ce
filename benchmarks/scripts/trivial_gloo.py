"""The trivial job of the launch benchmark: init, one all_reduce, destroy."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
dist.destroy_process_group()
