"""Print ``--dry-run``'s per-rank predictions (JSON) for several layouts: one argv per line on stdin. A layout
refused in one line (a ``RapidliteError``) is ``{"error": line}``."""

import json
import shlex
import sys

from rapidlite.errors import RapidliteError
from rapidlite.planning import plan
from rapidlite.planning.report import plan_records
from rapidlite.resolve import parse_args

out = {}
for line in sys.stdin.read().splitlines():
    name, _, argv = line.partition(" ")
    try:
        out[name] = plan_records(plan(parse_args(shlex.split(argv)).sections))
    except RapidliteError as e:
        out[name] = {"error": str(e)}
print(json.dumps(out))
