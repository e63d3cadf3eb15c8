"""Print ``--dry-run``'s per-rank predictions (JSON) for several layouts: one argv per line on stdin."""

import json
import shlex
import sys

from rapidlite.planning import plan
from rapidlite.planning.report import plan_records
from rapidlite.resolve import parse_args

out = {}
for line in sys.stdin.read().splitlines():
    name, _, argv = line.partition(" ")
    out[name] = plan_records(plan(parse_args(shlex.split(argv)).sections))
print(json.dumps(out))
