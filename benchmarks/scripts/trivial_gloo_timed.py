"""The launch benchmark's trivial job, printing when its script starts and ends (wall clock)."""
import time

started = time.time()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
dist.destroy_process_group()
print(f"script {started} {time.time()}", flush=True)
