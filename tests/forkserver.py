"""Python processes for the tests, forked from one that has already imported torch and potluck.

A fresh interpreter spends about 3 CPU-seconds importing torch, and the suite starts about a
hundred of them on 2 cores. `Popen` (a `subprocess.Popen`) starts `python -m module ...`,
`python script.py ...` and `python -c code` by forking a warm server instead. The child then
runs the program as a fresh interpreter would: its argv, environment, working directory,
standard streams and `sys.path`, `__main__`, new seeds for `random`, numpy and torch, and the
interpreter's own shutdown (atexit, flushing, the exit status); signals go to it directly.
What differs: the string hash seed is the server's, shared by its children (a fresh interpreter
draws its own); the demos and most scenario tests start fresh interpreters, and keep checking that
peers agree whatever their hash seeds. Anything else (another executable, interpreter options, a
PYTHON*, OMP_* or TORCH_* setting the server does not share, other than PYTHONPATH entries of
this tree, PYTHONUNBUFFERED and OMP_NUM_THREADS, preexec_fn, pass_fds) starts the
ordinary way, as does every process when POTLUCK_TEST_FORK=0.

The server is started on first use, one per test process, and exits when that process does (its
standard input is the lifeline). Each request forks a waiter, which forks the program and
reports its pid and then its wait status over the request's connection.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Environment settings read when an interpreter or torch starts: a child whose value differs from
# the server's would not get it, so it starts the ordinary way.
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "TORCH_", "CUDA_", "LD_")
_HANDLED = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS"}
_PRELOAD = ("torch", "numpy", "scipy.optimize", "potluck", "potluck.cli", "potluck.cli.demo", "potluck.cli.pipeline",
            "potluck.cli.ps", "potluck.cli.peer", "potluck.optim", "potluck.pipeline", "potluck.ps", "potluck.moe")
_HEADER = struct.Struct("!I")


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) and k not in _HANDLED}


class _Server:
    """The client's handle on its warm server (started on first use)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="potluck-forkserver-")
        self.path = os.path.join(self.dir, "socket")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(self.pythonpath()))
        self.env = _startup_env(env)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=ROOT)
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the test fork server did not start: {line!r}")
        atexit.register(self.close)

    @staticmethod
    def pythonpath() -> list[str]:
        return [os.path.join(ROOT, "src"), ROOT]

    def accepts(self, argv: list[str], env: dict[str, str] | None) -> bool:
        env = os.environ if env is None else env
        entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        return (_startup_env(dict(env)) == self.env and all(os.path.abspath(p) in self.pythonpath() for p in entries)
                and _program(argv) is not None)

    def close(self) -> None:
        self.proc.stdin.close()  # its lifeline: the server exits
        self.proc.wait(10)
        self.proc.stdout.close()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


_server: _Server | None = None
_server_lock = threading.Lock()


def _the_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        return _server


def _program(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """(kind, target, args) of `python ...` argv that a forked child can run, else None."""
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    first, rest = argv[1], list(argv[2:])
    if first in ("-m", "-c"):
        return (first, rest[0], rest[1:]) if rest else None
    if first.startswith("-"):
        return None
    return "script", first, rest


class Popen(subprocess.Popen):
    """`subprocess.Popen`, whose Python programs start forked from the warm server (see the module)."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        self._waiter = None
        argv = [os.fspath(a) for a in args] if not isinstance(args, (str, bytes)) else None
        # (restore_signals, gid, gids, uid, umask, start_new_session[, process_group]) as this Python passes them
        _, gid, gids, uid, umask, start_new_session, *group = rest
        plain = gid is None and gids is None and uid is None and umask < 0 and group in ([], [-1], [None])
        if (os.environ.get("POTLUCK_TEST_FORK") == "0" or argv is None or shell or executable is not None
                or preexec_fn is not None or pass_fds or not plain or not _the_server().accepts(argv, env)):
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, *rest)
        request = json.dumps({"argv": argv, "env": dict(os.environ if env is None else env),
                              "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                              "new_session": bool(start_new_session)}).encode()
        fds = [fd if fd != -1 else default for fd, default in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        waiter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            waiter.connect(_the_server().path)
            socket.send_fds(waiter, [_HEADER.pack(len(request)) + request], fds)
            self._received = b""
            line = self._line(waiter)
            if not line:
                raise OSError(f"the test fork server did not start {argv}")
            self.pid = int(line)
        except BaseException:
            waiter.close()
            raise
        finally:
            # What the child holds now (as subprocess does after its fork)
            if p2cread != -1 and p2cwrite != -1:
                os.close(p2cread)
            if c2pwrite != -1 and c2pread != -1:
                os.close(c2pwrite)
            if errwrite != -1 and errread != -1 and errwrite != c2pwrite:
                os.close(errwrite)
            devnull = getattr(self, "_devnull", None)
            if devnull is not None:
                os.close(devnull)
                del self._devnull
        self._waiter = waiter
        self._child_created = True

    def _line(self, waiter: socket.socket) -> bytes:
        """The waiter's next line (b"" if it closed first), without reading past it."""
        while b"\n" not in self._received:
            more = waiter.recv(64)
            if not more:
                return b""
            self._received += more
        line, self._received = self._received.split(b"\n", 1)
        return line

    def _try_wait(self, wait_flags):
        if self._waiter is None:
            return super()._try_wait(wait_flags)
        if wait_flags & os.WNOHANG and b"\n" not in self._received and not select.select([self._waiter], [], [], 0)[0]:
            return 0, 0
        line = self._line(self._waiter)
        self._waiter.close()
        # A waiter that vanished without a status (killed with the server): report the child dead
        return self.pid, int(line) if line else 9

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self._waiter is None:
            return super()._internal_poll(_deadstate=_deadstate, **kwargs)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def run(args, *, input=None, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` through `Popen` above."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args, out, err)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


# The server side -------------------------------------------------------------------------------


def _serve(path: str) -> dict:
    """Accept requests until the lifeline (standard input) closes; return a request in its child."""
    for name in _PRELOAD:
        __import__(name)
    assert threading.active_count() == 1, "imports started threads: forking would copy them half-way"
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters reap themselves
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable:
            os._exit(0)
        conn, _ = listener.accept()
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            (size,) = _HEADER.unpack_from(data)
            data = data[_HEADER.size:]
            while len(data) < size:
                more = conn.recv(size - len(data))
                if not more:
                    raise EOFError("request cut short")
                data += more
            request = json.loads(data)
        except (OSError, EOFError, ValueError, struct.error):
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            child = os.fork()
            if child == 0:
                _become(request, fds, conn)
                return request
            try:
                conn.sendall(b"%d\n" % child)
                _, status = os.waitpid(child, 0)
                conn.sendall(b"%d\n" % status)
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _become(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: take the request's streams, session, directory and environment."""
    import io

    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    if request["new_session"]:
        os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding

    def stream(fd: int, errors: str, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=encoding, errors=errors,
                                line_buffering=line_buffering or os.isatty(fd), write_through=unbuffered)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    sys.stdout = sys.__stdout__ = stream(1, "strict", False)
    sys.stderr = sys.__stderr__ = stream(2, "backslashreplace", True)
    import numpy
    import torch
    numpy.random.seed()
    torch.seed()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # read by OpenMP when it loaded, in the server
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _run(request: dict) -> None:
    """Run the request's program as `python ...` would in a fresh interpreter."""
    import runpy

    kind, target, args = _program(request["argv"])
    pythonpath = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in _Server.pythonpath()]
    first = {"-m": os.getcwd(), "-c": ""}.get(kind, os.path.dirname(os.path.realpath(target)))
    sys.path[:] = [first, *pythonpath, *base]
    if kind == "-m":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "-c":
        sys.argv = ["-c", *args]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    _run(_serve(sys.argv[1]))
