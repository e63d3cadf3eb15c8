"""Workers forked from the launcher, the training code already imported (``--start-method fork``).

torchrun starts each worker as a new interpreter (``python -u -m rapidlite ARGV``), which imports torch, the
engine and transformers again: 2-5 s of CPU per rank before the first step, every rank at once, and on a
shared file system every rank reading the same files. Forked from a launcher that imported them once, a worker
starts at once and shares those pages with its peers until it writes them.

The fork stands in for ``subprocess.Popen`` under torchrun's own agent (``ForkedHandler``), so everything the agent
does with a worker is unchanged: its environment (``RANK``, ``LOCAL_RANK``, the error file), a session of its
own, the exit code it polls, the signals it sends. The child sets the environment the worker would have been
started with, drops the launcher's exit handlers, puts the signal handlers back to an interpreter's defaults, makes
its output unbuffered (``-u``) and runs the same module or script as ``__main__`` (``runpy``), ending with its exit
code.

A process that has touched CUDA cannot be forked (the child's CUDA calls fail), so ``auto`` forks only on
machines without a CUDA device; there, and with ``spawn``, workers are new processes as torchrun starts them.
"""

from __future__ import annotations

import atexit
import io
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import warnings
from typing import Any, NoReturn

from rapidlite.runtime.streams import flush_std_streams

# Handlers the launcher (or torchrun's agent) may have set, which a new interpreter would not have.
_RESET_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGCHLD")


def fork_workers(start_method: str) -> bool:
    """Whether the launcher forks its workers: ``fork``, or ``auto`` on a machine without a CUDA device."""
    if start_method != "auto":
        return start_method == "fork"
    import torch

    return not torch.cuda.is_available()


def warm_imports(model: str | None = None) -> None:
    """Import in the launcher what every worker imports below rapidlite (torch's dynamo, which a torch optimizer's
    first step imports) and, for a transformers model (a name or directory), its modeling module: the workers
    forked afterwards find them loaded. The command line adds rapidlite's own (``launch``'s ``warm``). A warm-up
    only: a worker imports whatever it still lacks."""
    import torch._dynamo  # noqa: F401

    if model:
        try:
            from transformers import AutoConfig
            from transformers.models.auto.configuration_auto import model_type_to_module_name

            module = model_type_to_module_name(AutoConfig.from_pretrained(model).model_type)
            __import__(f"transformers.models.{module}.modeling_{module}")
        except Exception:  # unreadable here: the worker's own load says why
            pass


class ForkedProcess:
    """The part of ``subprocess.Popen`` torchrun's agent uses (``pid``, ``poll``, ``wait``, ``returncode``), for a
    worker forked from this process."""

    def __init__(self, args: tuple, env: dict[str, str], stdout: Any, stderr: Any) -> None:
        flush_std_streams()  # what the launcher printed is not printed again by the child
        self.args = args
        self.returncode: int | None = None
        with warnings.catch_warnings():  # Python 3.12+ warns of forking a process with threads (the agent's store)
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:
            _child(args, env, stdout, stderr)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def python_command(args: tuple) -> tuple[str, list[str], bool] | None:
    """``(entry, argv, is_module)`` for torchrun's ``python -u [-m] ENTRY ARGV``; None for any other command
    (another interpreter, ``numactl`` in front), which is started as a new process instead."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
        return None
    if args[2] == "-m":
        return (args[3], list(args[4:]), True) if len(args) > 3 else None
    return args[2], list(args[3:]), False


def _child(args: tuple, env: dict[str, str], stdout: Any, stderr: Any) -> NoReturn:
    code = 1
    try:
        os.setsid()  # a session of its own, as torchrun starts its workers: the agent signals its group
        atexit._clear()  # the launcher's exit handlers are not the worker's (a new interpreter has none)
        for stream, fd in ((stdout, 1), (stderr, 2)):
            if stream is not None:
                os.dup2(stream.fileno(), fd)
        os.environ.clear()
        os.environ.update(env)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
            # A new interpreter's OpenMP reads the variable as it loads; this one was loaded by the launcher.
            sys.modules["torch"].set_num_threads(int(threads))
        for name in _RESET_SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _name_process(f"rapidlite-r{os.environ.get('RANK', '')}")
        sys.stdout = _unbuffered(1, sys.stdout)
        sys.stderr = _unbuffered(2, sys.stderr)
        entry, argv, is_module = python_command(args)
        sys.argv = [entry, *argv]
        if is_module:
            runpy.run_module(entry, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(entry)))
            runpy.run_path(entry, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        flush_std_streams()
        os._exit(code)


def _name_process(name: str) -> None:
    """The name ``ps``, ``top`` and ``/proc/PID/comm`` show (15 characters on Linux): a forked worker's command
    line and ``/proc/PID/environ`` are its launcher's, so its name says its rank."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:  # not Linux
        pass


def _unbuffered(fd: int, like: Any) -> io.TextIOWrapper:
    """A text stream on ``fd`` as ``python -u`` opens it (every write reaches the file at once), in the encoding
    of the launcher's stream ``like``."""
    raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115
    encoding = getattr(like, "encoding", None) or "utf-8"
    errors = getattr(like, "errors", None) or "strict"
    return io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)


def handler_factory() -> Any:
    """torchrun's ``get_subprocess_handler`` for workers that are forked (``ForkedHandler``)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    class ForkedHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            if python_command(args) is None:
                return super()._popen(args, env)
            return ForkedProcess(args, env, self._stdout, self._stderr)

    def get_subprocess_handler(**kwargs: Any) -> Any:
        return ForkedHandler(**kwargs)

    return get_subprocess_handler
