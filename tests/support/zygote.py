"""A preloaded launcher for the services the tests start: a zygote.

Every service process the suite starts used to be a new interpreter that
imported torch and transformers (8-10 s of CPU each on a 2-core host, ~70
of them per run: most of the suite's time). The zygote imports them once,
then forks a service per request: the child sets up its standard error,
environment, working directory and arguments as `subprocess.Popen` would,
then runs `mmsplit_cli.main.main` exactly as `python -m mmsplit_cli` does.
What the services themselves do at start (load the model, fork ranks and
forkservers, bind, serve) is unchanged; only the interpreter's imports are
skipped. A service under a wrapper the tests build (namespaces, the
open-file limit) is forked too: the child takes the wrapper's steps first
(`tests/support/wrapped.py`: the same system calls the wrapper would make
before its exec). The production services are never started this way: the
demo, the benchmarks as people run them, `mmsplit serve`, the tests that
check the real start-up (`tests.support.services.new_interpreters`) and a
service under any other wrapper still exec a new interpreter
(`mmsplit_cli.launch`). The suite's own runs of the benchmarks fork their
services from the suite's zygote (`fork_from_the_suite_s_zygote`).

Why a fork of an importing process is safe here: the zygote runs no thread
(it checks) and no torch computation before it forks, which is the same
condition the services already rely on when they fork their ranks
(`scheduler_svc.group.start_late`) and their CPU pool's forkserver
(`tokenizer_svc.forkserver.start_forked`).

The suite's runs of the benchmark scripts are forks too (`run_script`:
the script run as `__main__` with `runpy`, as `python bench/X.py` runs
it, standard output piped back): they import what the services do.

Protocol, over a Unix SOCK_SEQPACKET socket (message boundaries kept, file
descriptors passed with SCM_RIGHTS): one connection per service. The client
sends one JSON message {"argv", "env", "cwd", "new_session", "steps", and
"script" for a script} with the write end of its standard-error pipe
attached (and of its standard output's, for a script); the zygote answers {"pid": N} once forked,
and {"returncode": R} (Popen's convention: -signal if killed) once the
child has ended and been reaped, then closes the connection. The zygote
leaves when its standard input closes (the test process ended), killing
whatever it started that is still running.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

ZYGOTE_AT = "MMSPLIT_TEST_ZYGOTE_AT"  # its socket, for the processes a test starts (a benchmark)

# What the services import. Anything missing here is imported by the child
# itself, correctly, only more slowly.
PRELOAD = [
    "mmsplit_cli.main",
    "mmsplit_cli.config",
    "scheduler_svc.settings",
    "scheduler_svc.group",
    "scheduler_svc.server",
    "scheduler_svc.ranks",
    "scheduler_svc.engine",
    "scheduler_svc.model",
    "tokenizer_svc.settings",
    "tokenizer_svc.forkserver",
    "tokenizer_svc.server",
    "tokenizer_svc.preprocess",
    "tokenizer_svc.worker",
    "mmsplit_server.families",
    "torch.distributed",
    "transformers.models.llava.modeling_llava",
    "transformers.models.llava_next.modeling_llava_next",
    "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.clip.modeling_clip",
    "transformers.models.llava.processing_llava",
    "transformers.models.llava_next.processing_llava_next",
    "transformers.models.qwen2_vl.processing_qwen2_vl",
    "transformers.models.qwen2_5_vl.processing_qwen2_5_vl",
    "transformers.models.clip.image_processing_pil_clip",
    "transformers.models.llava_next.image_processing_pil_llava_next",
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
    "transformers.models.qwen2_vl.video_processing_qwen2_vl",
    "transformers.models.llama.tokenization_llama",
    "transformers.models.qwen2.tokenization_qwen2",
    "av",
    "PIL.Image",
]

READY = "zygote ready"


# ---------------------------------------------------------------- the zygote


def serve(address: str) -> None:
    """Preload, listen at `address`, fork services until stdin closes."""
    from mmsplit_cli.main import openmp_defaults  # imports no torch

    openmp_defaults(os.environ)  # as mmsplit_cli.main, before torch
    for module in PRELOAD:
        with contextlib.suppress(ImportError):  # a module transformers renamed: the child imports what it needs
            importlib.import_module(module)
    if threading.active_count() > 1:
        raise SystemExit(f"zygote: {threading.active_count()} threads after the imports; forking would be unsafe")
    # What the services do at the end of their start-up (mmsplit_server.gcheap.freeze),
    # done here for the imports every child shares: a child's own collection then
    # walks only what it made (the suite's ~150 services each walked the ~400,000
    # imported objects again: 0.3-0.8 s apiece, a sixth of the suite's CPU).
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}
    print(READY, flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                own = [listener.fileno(), wake_r, wake_w, selector.fileno(), *(c.fileno() for c in children.values())]
                pid = _fork_service(conn, own)
                if pid:
                    children[pid] = conn
                else:
                    conn.close()
            elif key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                _reap(children)
            elif not sys.stdin.buffer.read1(1):  # the test process is gone
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                for pid in list(children):
                    os.waitpid(pid, 0)
                return


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            conn.close()


def _fork_service(conn: socket.socket, own_fds: Sequence[int]) -> int:
    """Read one request from `conn` and fork its service: the child's pid
    (reported to the client), or 0 if the request was unreadable."""
    fds = array.array("i")
    try:
        data, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(fds.itemsize))
    except OSError:
        return 0
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data or len(fds) not in (1, 2):
        for fd in fds:
            os.close(fd)
        return 0
    request = json.loads(data)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _become_service(request, list(fds), [conn.fileno(), *own_fds])
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    return pid


def _become_service(request: dict, fds: list[int], close: Sequence[int]) -> None:
    """In the child: what Popen and a fresh `python -m mmsplit_cli` (or
    `python SCRIPT`) would have set up, then the service (or the script).
    `fds`: standard error's write end, and standard output's for a
    script. Never returns."""
    code = 1
    try:
        if request.get("new_session"):
            os.setsid()  # Popen's start_new_session: a Ctrl-C to its group reaches it alone
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(fds[1] if len(fds) > 1 else devnull, 1)
        os.dup2(fds[0], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        tempfile.tempdir = None  # read TMPDIR again
        if request.get("steps"):
            from tests.support import wrapped

            wrapped.take(request["steps"])  # the wrapper's limits and namespaces
        script = request.get("script")
        if script:
            sys.argv = [script, *request["argv"]]
            sys.path.insert(0, os.path.dirname(script))  # as the interpreter does for a script
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = ["mmsplit", *request["argv"]]
            from mmsplit_cli.main import main

            main(request["argv"])
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        # What the interpreter's exit would run (a service's own stop leaves
        # by os._exit before this: `mmsplit_server.serving.exit_now`).
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------- the client


def fork_under(
    address: Callable[[], str],
    argv: Sequence[str],
    env: dict[str, str],
    new_session: bool,
    wrapper: Sequence[str],
    first: Sequence[Sequence[str]] = (),
) -> ForkedProcess | None:
    """A service forked by the zygote at `address()` (asked only when it
    forks) under `wrapper`, taken as steps after the steps `first`; None
    where the zygote does not know the wrapper (a new interpreter then)."""
    from tests.support import wrapped

    steps = wrapped.steps(wrapper)
    if steps is None:
        return None
    return ForkedProcess(address(), list(argv), env, new_session, [*first, *steps])


def fork_from_the_suite_s_zygote() -> None:
    """In a process a test started with `zygote_for_subprocesses()`: start
    services as forks of the suite's zygote (saving each its imports: ~10 s
    of CPU for a tokenizer, ~5 s for a scheduler), in this process's mount
    namespace (a benchmark that made one with a /dev/shm of its own).
    Services under a wrapper the zygote does not know stay new interpreters."""
    from mmsplit_cli.launch import set_launcher

    address = os.environ.get(ZYGOTE_AT)
    if not address:
        return
    here = [["mounts_of", str(os.getpid())]]

    def launch(
        argv: Sequence[str], env: dict[str, str], new_session: bool, wrapper: Sequence[str]
    ) -> ForkedProcess | None:
        return fork_under(lambda: address, argv, env, new_session, wrapper, here)

    set_launcher(launch)


class Zygote:
    """The test process's handle on its zygote (started on first use)."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.address = str(workdir / "zygote.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", self.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != READY:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the zygote did not start (it said {line!r}, exit {self.proc.poll()})")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(
        self, argv: Sequence[str], env: dict[str, str], new_session: bool = False, steps: Sequence[Sequence[str]] = ()
    ) -> ForkedProcess:
        return ForkedProcess(self.address, list(argv), env, new_session, steps)

    def close(self) -> None:
        """Stop it (it kills anything it started that still runs)."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ForkedProcess:
    """What `mmsplit_cli.launch.ServiceProcess` needs of a `subprocess.Popen`
    (pid, stderr as text lines, poll, wait, send_signal, kill,
    returncode), for a service the zygote forked."""

    def __init__(
        self,
        address: str,
        argv: list[str],
        env: dict[str, str],
        new_session: bool = False,
        steps: Sequence[Sequence[str]] = (),
        script: str | None = None,
        cwd: str | None = None,
    ) -> None:
        """A service (`argv` of `mmsplit`), or with `script` that script
        (`argv` its arguments), its standard output then readable too."""
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(address)
        pipes = [os.pipe() for _ in range(2 if script else 1)]  # standard error's, standard output's
        try:
            request = {"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "new_session": new_session, "steps": steps}
            if script:
                request["script"] = script
            message = json.dumps(request).encode()
            ends = array.array("i", [w for _, w in pipes])
            self._conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, ends)])
        finally:
            for _, write_end in pipes:
                os.close(write_end)
        reply = self._conn.recv(4096)
        if not reply:
            for read_end, _ in pipes:
                os.close(read_end)
            self._conn.close()
            raise RuntimeError("the zygote did not fork the service")
        self.pid: int = json.loads(reply)["pid"]
        # The caller's to read and close.
        self.stderr = open(pipes[0][0], encoding="utf-8", errors="replace")  # noqa: SIM115
        self.stdout = open(pipes[1][0], encoding="utf-8", errors="replace") if script else None  # noqa: SIM115
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._finished(self._conn.recv(4096))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.setblocking(True)
            self._conn.settimeout(timeout)
            try:
                self._finished(self._conn.recv(4096))
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def _finished(self, reply: bytes) -> None:
        # An empty reply: the zygote itself is gone; it killed its children.
        self.returncode = json.loads(reply)["returncode"] if reply else -signal.SIGKILL
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        # Until the zygote has reported the exit, the pid is ours (at worst
        # a zombie the zygote has not reaped yet), never a reused one.
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1])
