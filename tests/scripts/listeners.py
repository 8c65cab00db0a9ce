"""Rank 0 prints the local address of every socket this job listens on (from /proc)."""
import os

import torch.distributed as dist


def store_addresses(port):
    """Where the store the workers share (MASTER_PORT) listens, whichever process serves it."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, hexport = fields[1].split(":")
            if fields[3] == "0A" and int(hexport, 16) == port:
                found.append(address)
    return found


def listening_addresses(pids):
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].split(":")[0])
    return found


dist.init_process_group("gloo")
if dist.get_rank() == 0:
    for address in listening_addresses([os.getpid(), os.getppid()]):
        print("listen", address)
    for address in store_addresses(int(os.environ["MASTER_PORT"])):
        print("listen", address)
dist.barrier()
dist.destroy_process_group()
