"""`python -m cflib.train PARAMS.json`: one torchrun worker (cflib.train.launch starts them)."""
import json
import sys
from pathlib import Path

from cflib.errors import ParamError
from cflib.jobs import one_line_errors
from cflib.train.launch import worker

PROG = "python -m cflib.train"

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit(f"usage: {PROG} PARAMS.json: a torchrun worker of the run the JSON file describes "
                         "(train_sft.ipynb, or cflib.train.train, writes it and starts the workers)")
    with one_line_errors(PROG):  # before torchrun's error summary: no traceback for these
        try:
            json.loads(Path(sys.argv[1]).read_text())
        except json.JSONDecodeError as err:
            raise ParamError(f"{sys.argv[1]}: not a JSON parameter file ({err})") from None
    worker(sys.argv[1])
