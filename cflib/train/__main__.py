"""`python -m cflib.train PARAMS.json`: one torchrun worker (cflib.train.launch starts them)."""
import sys

from cflib.train.launch import worker

if __name__ == "__main__":
    worker(sys.argv[1])
