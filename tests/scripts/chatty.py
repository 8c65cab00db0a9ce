"""Each rank prints about 300 KB: 3000 numbered lines of 100 characters."""
import os
import sys

rank = os.environ["RANK"]
for i in range(3000):
    sys.stdout.write(f"{i:05d} " + rank * 94 + "\n")
print("last line", flush=True)
