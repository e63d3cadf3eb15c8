"""What every rapidlite command's ``main`` does around its work, in one place: a user error is one line and
its exit code (2); in a torchrun worker every failure is recorded for the launcher instead of printed; the
process ends through ``distributed.shutdown``'s clean teardown once torch is loaded (``--help`` and flag
errors never load it, so they stay fast)."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from rapidlite.errors import RapidliteError
from rapidlite.observe.progress import close_bars
from rapidlite.runtime.streams import flush_std_streams


def _worker_failure(e: BaseException) -> int:
    from rapidlite.runtime.distributed import report_worker_error

    return report_worker_error(e)


def run_command(run: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    """``run(argv)`` (default: this process's arguments) with rapidlite's error handling and teardown."""
    argv = list(sys.argv[1:] if argv is None else argv)
    worker = bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))  # started by torchrun
    try:
        code = run(argv)
    except RapidliteError as e:
        if e.exit_code == 2 and "rapidlite.observe.logging" in sys.modules:  # refused: leaves no rank log
            sys.modules["rapidlite.observe.logging"].discard_rank_log()
        code = _worker_failure(e) if worker else e.exit_code
        close_bars()
        if not worker:
            sys.stdout.flush()
            print(f"rapidlite: error: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        close_bars()
        print("rapidlite: interrupted", file=sys.stderr, flush=True)
        code = 130
    except Exception as e:
        close_bars()  # the traceback starts on a line of its own
        if not worker:
            raise
        code = _worker_failure(e)
    if "torch" in sys.modules:
        from rapidlite.runtime.distributed import shutdown

        shutdown(code)  # in a worker: barrier, destroy the process group, os._exit; otherwise returns
    return code


def end_process(code: int) -> NoReturn:
    """End a command-line process (``rapidlite``, ``python -m rapidlite``) with ``code``.

    Once torch and transformers are loaded, the interpreter's own teardown (freeing every module) takes about a
    second, after the run is done. Like a launched worker (``distributed.shutdown``), the process skips it: the
    exit handlers still run (logging flushed, temporary directories removed, child processes reaped), streams are
    flushed, then ``os._exit``. A process whose non-daemon threads are still running exits the ordinary way,
    which waits for them."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if "torch" not in sys.modules or others:
        sys.exit(code)
    atexit._run_exitfuncs()
    flush_std_streams()
    os._exit(code)
