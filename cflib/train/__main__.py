"""`python -m cflib.train PARAMS.json`: one torchrun worker (cflib.train.launch starts them)."""
import sys

from cflib.errors import ParamError
from cflib.jobs import one_line_errors
from cflib.jsonio import read_json
from cflib.train.launch import worker

PROG = "python -m cflib.train"

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit(f"usage: {PROG} PARAMS.json: a torchrun worker of the run the JSON file describes "
                         "(train_sft.ipynb, or cflib.train.train, writes it and starts the workers)")
    with one_line_errors(PROG):  # before torchrun's error summary: no traceback for these
        read_json(sys.argv[1], ParamError, "JSON parameter file")
    worker(sys.argv[1])
