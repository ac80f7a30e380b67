"""`python -m cflib.train PARAMS.json [REGISTERED.json]`: one torchrun worker (cflib.train.launch starts them);
REGISTERED.json names the registered losses, metrics and attention backends it imports first
(cflib.train.registered)."""
import sys

from cflib.errors import ParamError
from cflib.jobs import one_line_errors
from cflib.jsonio import read_json
from cflib.train.launch import REGISTERED_WHAT, worker

PROG = "python -m cflib.train"

if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or any(argument.startswith("-") for argument in sys.argv[1:]):
        raise SystemExit(f"usage: {PROG} PARAMS.json [REGISTERED.json]: a torchrun worker of the run the JSON "
                         "file describes, after importing the registered losses, metrics and attention backends "
                         "REGISTERED.json names (train_sft.ipynb, or cflib.train.train, writes them and starts the "
                         "workers)")
    with one_line_errors(PROG):  # before torchrun's error summary: no traceback for these
        for path, what in zip(sys.argv[1:], ("JSON parameter file", REGISTERED_WHAT)):
            read_json(path, ParamError, what)
    worker(*sys.argv[1:])
