"""The sandbox: where code a model wrote runs (the ``python`` environments, the ``code_tests`` reward, HumanEval,
``oumi-megatron sandbox``). Such code is hostile input: it never runs in a trainer's process, only here.

``Sandbox(isolation, workers, limits)`` keeps ``workers`` server processes (utils/sandbox_server.py: a pre-started
interpreter each, which forks once per program and never runs a program itself) and runs each program on an idle one:
``run(code)`` from any thread, ``run_many(codes)`` over all of them at once. A program gets a time limit (wall and
CPU), a memory limit, a process-count limit, a cap on each of stdout and stderr, a fresh working folder removed
afterwards, an environment without the caller's variables, and every process it left is killed before the result
comes back. Where a memory cgroup can be made below the caller's, each server and its programs get one of
``memory_mb``: all of a program's processes together stay under it. What a program does is its result
(``Execution``: exit status, signal, timeout, output); a failure of the sandbox itself is a ``SandboxError``.

Isolation (``isolation``; ``Sandbox.description`` says what is in force):
- ``namespaces`` (root, Linux): mount, network, PID, IPC and UTS namespaces; a read-only root of the system's library
  folders and the interpreter; no network interface; programs as a uid of their own (``UID_BASE`` + ...), without
  capabilities;
- ``bwrap``: the same namespaces from bubblewrap (installed, for users who are not root; their programs run as the
  caller's uid inside them);
- ``auto``: the first of those this machine has; none: ``SandboxUnavailable``, with the fixes;
- ``limits_unsafe``: limits only: the program can read this machine's files and reach the network. Never chosen by
  ``auto``: the user opts out by this name.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from oumi_megatron.utils.sandbox_server import PIPE_BYTES, SYSTEM_DIRS, WORK_ROOT

logger = logging.getLogger("oumi")

ISOLATIONS = ("auto", "namespaces", "bwrap", "limits_unsafe")
"""``grpo.sandbox.isolation``'s values."""
UID_BASE = 2_000_000_000
"""Programs run as uid (and gid) ``UID_BASE + (pid % 2**20) * 64 + worker``: a uid of their own per worker of each
process (never a user's), so RLIMIT_NPROC counts one program's processes alone and no program can signal another's."""
MAX_WORKERS = 64
SERVER = Path(__file__).with_name("sandbox_server.py")
START_TIMEOUT_S = 30.0
REPLY_MARGIN_S = 10.0
"""A server that has not answered ``timeout_s`` + this after a request is broken: it is killed and replaced."""


class SandboxError(RuntimeError):
    """The sandbox failed (not the program it ran): a server that died or did not answer."""


class SandboxUnavailable(SandboxError):
    """The isolation asked for is not available on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    timeout_s: float = 10.0
    """Wall-clock seconds; the program and every process it started are killed then."""
    cpu_s: float | None = None
    """CPU seconds of each process (RLIMIT_CPU); None: ``timeout_s``."""
    memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS), MiB, and of all of a program's processes together where the sandbox
    has a memory cgroup (its servers' limit is the sandbox's own ``memory_mb``)."""
    max_processes: int = 32
    """Processes and threads at once (RLIMIT_NPROC of the program's own uid: enforced under ``namespaces``)."""
    max_output_bytes: int = 65536
    """Each of stdout and stderr is cut here (RLIMIT_FSIZE: a write past it fails), and so is any file it writes."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_processes", "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")
        if self.cpu_s is not None and not self.cpu_s > 0:
            raise ValueError(f"sandbox limit cpu_s must be > 0 or None, got {self.cpu_s!r}")

    def message(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "cpu_s": self.cpu_s if self.cpu_s is not None else self.timeout_s,
                "memory_mb": self.memory_mb, "max_processes": self.max_processes,
                "max_output_bytes": self.max_output_bytes}


@dataclass
class Execution:
    """What one program did."""

    exit_code: int | None
    """None when a signal ended it."""
    signal: int | None
    timed_out: bool
    """It reached the wall-clock or the CPU time limit and was stopped."""
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    cpu_s: float
    leftover_processes: int
    """Processes it left running when it ended (killed)."""
    timeout_s: float
    memory_exceeded: bool = False
    """The kernel killed one of its processes at the memory cgroup's limit (its processes together)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def problem(self) -> str | None:
        """Why the program did not end normally, in words (None: it exited with status 0)."""
        if self.timed_out:
            return f"it ran longer than the time limit ({self.timeout_s:g} s) and was stopped"  # wall or CPU
        if self.memory_exceeded:
            return "its processes together used more memory than the limit, and the kernel killed one"
        if self.signal is not None:
            import signal as signals

            try:
                name = signals.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            why = {"SIGXCPU": " (the CPU time limit)", "SIGKILL": " (a limit)", "SIGSEGV": " (a crash)"}.get(name, "")
            return f"it was killed by {name}{why}"
        if self.exit_code:
            return f"it exited with status {self.exit_code}"
        return None


def _uid(slot: int) -> int:
    return UID_BASE + (os.getpid() % (1 << 20)) * MAX_WORKERS + slot


_slots: set[int] = set()
_slots_lock = threading.Lock()


def _take_slot() -> int:
    """A server number no other running server of this process has (its programs' uid is its own)."""
    with _slots_lock:
        free = next((i for i in range(MAX_WORKERS) if i not in _slots), None)
        if free is None:
            raise SandboxError(f"this process runs {MAX_WORKERS} sandbox servers already; close a Sandbox first")
        _slots.add(free)
        return free


def _interpreter() -> str:
    """The base interpreter (not a venv's wrapper): run with -I -S, programs see the standard library alone."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _bwrap_command(interpreter: str, work_mb: int) -> list[str]:
    cmd = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--as-pid-1", "--new-session", "--clearenv"]
    if os.geteuid() == 0:  # no user namespace: the server keeps what it needs to run programs as a uid of their own
        cmd += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL"):
            cmd += ["--cap-add", cap]
    else:  # the user's own uid in a user namespace of its own
        cmd += ["--unshare-all"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        parents = [p for p in Path(prefix).parents if str(p) != "/"]
        for parent in reversed(parents):  # traversable by the programs' uid (bubblewrap makes them 0700)
            cmd += ["--perms", "0755", "--dir", str(parent)]
        cmd += ["--ro-bind", prefix, prefix]
    cmd += ["--ro-bind", str(SERVER), "/sandbox_server.py", "--dev", "/dev", "--size", str(work_mb << 20),
            "--tmpfs", WORK_ROOT, "--remount-ro", "/", "--chdir", "/", "--", interpreter, "-I", "-S", "/sandbox_server.py"]
    return cmd


def _check_readable_by_others(prefix: str) -> None:
    """``limits_unsafe`` as root runs programs as a uid of their own, on the host's files: that uid must reach the
    interpreter's standard library."""
    for folder in [prefix, *map(str, Path(prefix).parents)]:
        if not os.stat(folder).st_mode & 0o001:
            raise SandboxUnavailable(
                f"limits_unsafe runs programs as a uid of their own, which cannot reach this interpreter's standard "
                f"library at {prefix} ({folder} is not searchable by other users). Use isolation namespaces (root, the "
                f"default), or an interpreter installed where every user can read it.")


SERVER_MIB = 64
"""What a server itself may hold beside its program, in its memory cgroup."""


class _MemoryCgroup:
    """A memory cgroup of one server and its programs, below this process's own (cgroup v2 where the memory controller
    is delegated to it, else v1's memory hierarchy): all of a program's processes together stay under its limit (a
    fork bomb of memory bombs included); past it the kernel kills one of them. None where no such folder is writable
    (then each process has RLIMIT_AS alone)."""

    def __init__(self, folder: str, version: int) -> None:
        self.folder, self.version = folder, version

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> _MemoryCgroup | None:
        for version, parent in _cgroup_parents():
            folder = os.path.join(parent, name)
            try:
                os.mkdir(folder)
            except OSError:
                continue
            group = cls(folder, version)
            try:
                if version == 2:
                    group._write("memory.max", str(limit_bytes))
                    group._write("memory.swap.max", "0", optional=True)
                else:
                    group._write("memory.limit_in_bytes", str(limit_bytes))
                    group._write("memory.memsw.limit_in_bytes", str(limit_bytes), optional=True)
            except OSError:
                group.remove()
                continue
            return group
        return None

    def _write(self, name: str, value: str, optional: bool = False) -> None:
        path = os.path.join(self.folder, name)
        if optional and not os.path.exists(path):
            return
        with open(path, "w") as f:
            f.write(value)

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        """How many of its processes the kernel killed at the limit so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.folder, name)) as f:
                return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)
        except OSError:
            return 0

    def remove(self) -> None:
        deadline = time.monotonic() + 2.0
        while True:  # empty once the killed server's processes are gone
            try:
                os.rmdir(self.folder)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # left behind, empty of memory; the machine's cgroup tree keeps an empty folder
                time.sleep(0.01)


def _cgroup_parents() -> list[tuple[int, str]]:
    """(version, folder) of this process's own memory cgroups, v2 first (only where it may give memory to children)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    out: list[tuple[int, str]] = []
    for _, controllers, path in lines:
        for m in mounts:
            fstype = m[m.index("-") + 1]
            if controllers == "" and fstype == "cgroup2":
                folder = m[4] + path.rstrip("/")
                try:
                    with open(os.path.join(folder, "cgroup.subtree_control")) as f:
                        if "memory" in f.read().split():
                            out.insert(0, (2, folder))
                except OSError:
                    pass
            elif "memory" in controllers.split(",") and fstype == "cgroup" and "memory" in m[-1].split(","):
                out.append((1, m[4] + path.rstrip("/")))
    return [(v, f) for v, f in out if os.access(f, os.W_OK)]


class _Worker:
    """One server process (utils/sandbox_server.py) and its pipes."""

    def __init__(self, isolation: str, work_mb: int, memory_mb: int, slot: int | None = None) -> None:
        """``memory_mb``: what a program may hold in all (the server's memory cgroup, where one can be made); ``slot``:
        the number of the server this one replaces (else a free one of the process's)."""
        root = os.geteuid() == 0
        if isolation == "limits_unsafe" and root:
            _check_readable_by_others(os.path.realpath(sys.base_prefix))
        self.slot, self.isolation = _take_slot() if slot is None else slot, isolation
        slot = self.slot
        interpreter = _interpreter()
        self.folder = tempfile.mkdtemp(prefix="oumi-sandbox-")
        os.chmod(self.folder, 0o711)  # limits: the program's uid passes through to its folder
        """namespaces: the new root's mount point (empty on the host); limits: where the working folder is made."""
        setup = {"isolation": {"limits_unsafe": "limits"}.get(isolation, isolation), "work_mb": work_mb,
                 "uid": _uid(slot) if root else None, "gid": _uid(slot) if root else None,
                 "new_root": self.folder, "work_parent": self.folder, "executable": interpreter,
                 "prefixes": sorted({os.path.realpath(sys.base_prefix), os.path.dirname(interpreter)})}
        cmd = (_bwrap_command(interpreter, work_mb) if isolation == "bwrap"
               else [interpreter, "-I", "-S", str(SERVER)])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                     cwd="/", start_new_session=True, close_fds=True)
        # into its cgroup before the setup message: the server forks its namespaces' init, and that its programs, after
        self.cgroup = _MemoryCgroup.create(f"oumi-sandbox-{os.getpid()}-{slot}", (memory_mb + SERVER_MIB) << 20)
        if self.cgroup is not None:
            try:
                self.cgroup.add(self.proc.pid)
            except OSError:
                self.cgroup.remove()
                self.cgroup = None
        try:
            self._send(setup)
            reply = self._receive(time.monotonic() + START_TIMEOUT_S)
        except SandboxError:
            self.close()
            raise
        if not reply.get("ready"):
            self.close()
            raise SandboxUnavailable(reply.get("error", "the server did not start"))
        self.description: str = reply["description"] + (
            f"; memory: each program's processes together under {memory_mb} MiB (a cgroup v{self.cgroup.version})"
            if self.cgroup is not None else "; memory: per process (RLIMIT_AS; no memory cgroup can be made here)")

    def _send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode()
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(struct.pack(">I", len(data)) + data)
            self.proc.stdin.flush()
        except OSError as e:
            raise SandboxError(f"the sandbox server is gone ({e}){self._stderr()}") from e

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out = b""
        while len(out) < n:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise SandboxError("the sandbox server did not answer in time")
            chunk = os.read(fd, n - len(out))
            if not chunk:
                self.proc.wait(5)
                raise SandboxError(f"the sandbox server exited (status {self.proc.returncode}){self._stderr()}")
            out += chunk
        return out

    def _receive(self, deadline: float) -> dict[str, Any]:
        size = struct.unpack(">I", self._read(4, deadline))[0]
        return json.loads(self._read(size, deadline))

    def _stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return ""
        text = self.proc.stderr.read(4000).decode(errors="replace").strip()
        return f": {text}" if text else ""

    def run(self, message: dict[str, Any]) -> dict[str, Any]:
        before = self.cgroup.oom_kills() if self.cgroup is not None else 0
        self._send(message)
        reply = self._receive(time.monotonic() + message["timeout_s"] + REPLY_MARGIN_S)
        reply["memory_exceeded"] = self.cgroup is not None and self.cgroup.oom_kills() > before
        return reply

    def close(self, keep_slot: bool = False) -> None:
        """Stops the server; ``keep_slot``: its number goes to its replacement."""
        if not keep_slot:
            with _slots_lock:
                _slots.discard(self.slot)
        if self.proc.poll() is None:
            self.proc.kill()  # the server's namespace dies with it (PR_SET_PDEATHSIG)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):  # a request still buffered for a server that is gone
                    f.close()
        if self.cgroup is not None:
            self.cgroup.remove()  # waits until the server's processes are gone
        deadline = time.monotonic() + 2.0
        while True:  # the folder is the mount point of the server's new root until the server (its init) is gone
            try:
                shutil.rmtree(self.folder)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    logger.warning(f"sandbox: {self.folder} could not be removed (an empty folder)")
                    return
                time.sleep(0.01)


def _try_start(isolation: str, work_mb: int, memory_mb: int) -> tuple[_Worker | None, str]:
    try:
        return _Worker(isolation, work_mb, memory_mb), ""
    except (SandboxError, OSError) as e:
        return None, str(e)


class Sandbox:
    """``workers`` sandbox servers with ``isolation``; thread-safe. ``field``: the config field that sets the isolation,
    named in the error when it is not available."""

    def __init__(self, isolation: str = "auto", workers: int = 1, limits: Limits | None = None, work_mb: int = 64,
                 field: str = "grpo.sandbox.isolation") -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"{field}: unknown value {isolation!r}; one of {', '.join(ISOLATIONS)}")
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"sandbox workers must be in [1, {MAX_WORKERS}], got {workers!r}")
        self.limits = limits or Limits()
        self.work_mb = work_mb
        first, self.isolation = self._first_worker(isolation, work_mb, self.limits.memory_mb, field)
        self.description = f"{self.isolation}: {first.description.split(': ', 1)[-1]}"
        self._workers = [first]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._idle.put(first)
        try:
            for _ in range(1, workers):
                worker = _Worker(self.isolation, work_mb, self.limits.memory_mb)
                self._workers.append(worker)
                self._idle.put(worker)
        except BaseException:
            for worker in self._workers:
                worker.close()
            raise
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="oumi-sandbox")
        self._lock = threading.Lock()
        self.closed = False

    @staticmethod
    def _first_worker(isolation: str, work_mb: int, memory_mb: int, field: str) -> tuple[_Worker, str]:
        tried: list[str] = []
        candidates = ["namespaces", "bwrap"] if isolation == "auto" else [isolation]
        for name in candidates:
            if name == "namespaces" and (os.geteuid() != 0 or not hasattr(os, "unshare")):
                tried.append("namespaces: needs root (this process is not) and Linux")
                continue
            if name == "bwrap" and shutil.which("bwrap") is None:
                tried.append("bwrap: bubblewrap is not installed")
                continue
            worker, why = _try_start(name, work_mb, memory_mb)
            if worker is not None:
                return worker, name
            tried.append(f"{name}: {why}")
        fixes = "" if isolation == "limits_unsafe" else (
            " Run as root (Linux namespaces), install bubblewrap (e.g. apt install bubblewrap), or set "
            f"{field}: limits_unsafe to run such code with resource limits only: it can then read this machine's files "
            "and reach the network.")
        raise SandboxUnavailable(f"{field}: the sandbox for model-written code cannot start with isolation "
                                 f"{isolation!r} on this machine ({'; '.join(tried)}).{fixes}")

    @property
    def workers(self) -> int:
        return len(self._workers)

    @property
    def memory_cgroup(self) -> bool:
        """A program's processes together are held to ``limits.memory_mb`` (each server has a memory cgroup)."""
        return all(w.cgroup is not None for w in self._workers)

    def run(self, code: str, stdin: str | None = None, limits: Limits | None = None) -> Execution:
        """Runs ``code`` as ``python main.py`` would (``stdin``: its standard input) under ``limits`` (default the
        sandbox's), on the next idle server; blocks until it ends."""
        if self.closed:
            raise SandboxError("the sandbox is closed")
        lim = limits or self.limits
        message = {"code": code, "stdin": stdin, **lim.message()}
        if stdin is not None and len(stdin.encode()) > PIPE_BYTES:
            raise ValueError(f"a program's stdin takes at most {PIPE_BYTES} bytes, got {len(stdin.encode())}")
        worker = self._idle.get()
        try:
            reply = worker.run(message)
        except SandboxError:
            self._replace(worker)
            raise
        self._idle.put(worker)
        if "error" in reply:  # the server could not run it (its folder, its files), and serves the next
            raise SandboxError(f"the sandbox could not run the program: {reply['error']}")
        return Execution(**reply, timeout_s=lim.timeout_s)

    def run_many(self, codes: list[str], stdins: list[str | None] | None = None,
                 limits: Limits | None = None) -> list[Execution | SandboxError]:
        """Each of ``codes`` (``stdins[i]``: its standard input), ``workers`` at a time; in order. A program the sandbox
        failed on is its ``SandboxError``, in its place."""
        def one(i: int) -> Execution | SandboxError:
            try:
                return self.run(codes[i], stdins[i] if stdins else None, limits)
            except SandboxError as e:
                return e

        return list(self._pool.map(one, range(len(codes))))

    def _replace(self, worker: _Worker) -> None:
        worker.close(keep_slot=True)
        with self._lock:
            if self.closed:
                with _slots_lock:
                    _slots.discard(worker.slot)
                return
            fresh = _Worker(self.isolation, self.work_mb, self.limits.memory_mb, slot=worker.slot)
            self._workers[self._workers.index(worker)] = fresh
        self._idle.put(fresh)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._pool.shutdown(wait=False)
        for worker in self._workers:
            worker.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the hostile programs: `oumi-megatron sandbox check` and tests/test_sandbox.py -----------------------------------------
SECRET_VARIABLE = "OUMI_SANDBOX_CHECK_SECRET"
"""Put in the caller's environment before its sandbox starts; no program may read its value."""


@dataclass
class Hostile:
    """A program that tries to break out, and what its containment looks like."""

    name: str
    code: str
    """``{secret_file}``, ``{outside}`` (a folder of the host), ``{port}`` (a socket the host listens on) are filled in."""
    contained: Any
    """(Execution, the host's view) -> None when contained, else what got out."""
    cgroup_time_s: float = 0.0
    """Under a memory cgroup, the least time limit it runs with: the cgroup, not the clock, must be what stops it, and
    on a loaded machine its processes may not reach the cgroup's limit within a short time limit."""


def _no(text: str) -> Any:
    return lambda r, host: f"the output holds {text!r}" if text.format(**host) in r.stdout + r.stderr else None


HOSTILE: tuple[Hostile, ...] = (
    Hostile("infinite loop", "while True:\n    pass",
            lambda r, host: None if r.timed_out else "it was not stopped at the time limit"),
    Hostile("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            lambda r, host: None if not r.ok else "it ended normally"),
    Hostile("memory bomb", "chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))",
            lambda r, host: None if not r.ok and not r.timed_out else "it was not stopped at the memory limit",
            cgroup_time_s=10.0),
    Hostile("memory bombs in many processes",
            "import os, time\nfor _ in range(12):\n    if os.fork() == 0:\n        break\n"
            "chunk = bytearray(b'x') * (200 << 20)\ntime.sleep(3600)",
            lambda r, host: None if not r.ok and (r.memory_exceeded or not host["cgroup"]) else "it was not stopped",
            cgroup_time_s=30.0),
    Hostile("100 MB of output", "import sys\nfor _ in range(1_000_000):\n    sys.stdout.write('x' * 100)",
            lambda r, host: None if r.stdout_truncated and len(r.stdout) <= host["cap"] else "its output was not cut"),
    Hostile("socket to 127.0.0.1", "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "print('connected')", lambda r, host: "it reached the host's socket" if host["accepted"]() else None),
    Hostile("the parent's environment", "import os\nprint(dict(os.environ))\n"
            "for path in ('/proc/self/environ', '/proc/1/environ', '/proc/%d/environ' % os.getppid()):\n"
            "    try:\n        print(open(path).read())\n    except OSError:\n        pass", _no("{secret}")),
    Hostile("files outside the working folder", "for path in ('{secret_file}', '/etc/shadow', '/root/.bash_history'):\n"
            "    try:\n        print(open(path).read())\n    except OSError as e:\n        print('refused', e)",
            _no("{secret}")),
    Hostile("writing outside the working folder",
            "import os\nfor path in ('{outside}/escaped', '/tmp/oumi_sandbox_escaped', '/usr/oumi_sandbox_escaped', "
            "'../escaped', '/escaped'):\n    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError:\n        pass",
            lambda r, host: "a file appeared outside" if host["written"]() else None),
    Hostile("killing the parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)",
            lambda r, host: None),  # contained when the sandbox still runs the next program (checked after each)
    Hostile("segfault", "import ctypes\nctypes.string_at(0)",
            lambda r, host: None if r.signal is not None else "it was not ended by a signal"),
    Hostile("sys.exit", "import sys\nsys.exit(7)",
            lambda r, host: None if r.exit_code == 7 else f"exit status {r.exit_code}, not 7"),
    Hostile("a folder tree 5,000 levels deep", "import os\nfor _ in range(5000):\n    os.mkdir('d')\n    os.chdir('d')\n"
            "os.chmod('.', 0)\nprint('deep')", lambda r, host: None if r.ok and r.stdout == "deep\n" else "it did not run"),
    Hostile("a thread and a process that outlive the program",
            "import os, threading, time\nthreading.Thread(target=time.sleep, args=(3600,)).start()\n"
            "if os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\nprint('main ended')",
            lambda r, host: None if r.ok and not r.timed_out and r.leftover_processes >= 1 else "it was not ended"),
)


@dataclass
class CheckResult:
    name: str
    contained: bool
    detail: str


def sandbox_processes() -> int:
    """Processes running as the uid of a program of this process's sandboxes (0 where programs do not have uids of
    their own); other processes' sandboxes (another test worker's) have other uids."""
    first = _uid(0)
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                uid = os.stat(entry.path).st_uid
            except OSError:
                continue
            count += first <= uid < first + MAX_WORKERS
    return count


CHECK_LIMITS = Limits(timeout_s=2.0, memory_mb=512, max_processes=16, max_output_bytes=1 << 16)
"""The limits the hostile programs run under (``sandbox check``'s; its ``--timeout`` replaces the time)."""


@contextlib.contextmanager
def hostile_host(cap: int) -> Iterator[dict[str, Any]]:
    """The host's side of the checks: a folder with a secret file, a socket listening on 127.0.0.1, how to tell
    whether a program reached them (``cap``: the output limit the programs run under)."""
    import socket

    secret = os.environ.get(SECRET_VARIABLE) or "not-set"
    with tempfile.TemporaryDirectory(prefix="oumi-sandbox-check-") as outside, socket.socket() as listener:
        secret_file = os.path.join(outside, "secret.txt")
        Path(secret_file).write_text(secret)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)

        def accepted() -> bool:
            try:
                listener.accept()[0].close()
                return True
            except BlockingIOError:
                return False

        yield {"secret": secret, "secret_file": secret_file, "outside": outside, "port": listener.getsockname()[1],
               "cap": cap, "accepted": accepted,
               "written": lambda: sorted(os.listdir(outside)) != ["secret.txt"] or any(
                   os.path.exists(p) for p in ("/tmp/oumi_sandbox_escaped", "/usr/oumi_sandbox_escaped", "/escaped"))}


def check_hostile(sandbox: Sandbox, case: Hostile, host: dict[str, Any], limits: Limits = CHECK_LIMITS) -> CheckResult:
    """Runs ``case`` and checks from outside that it was contained: its result, the host's folder, socket and secrets
    (``host``), no process left, and the sandbox still running the next program."""
    host = {**host, "cgroup": sandbox.memory_cgroup}
    code = case.code.format(**{k: v for k, v in host.items() if isinstance(v, (str, int))})
    run_limits = limits
    if host["cgroup"] and case.cgroup_time_s > limits.timeout_s:
        run_limits = replace(limits, timeout_s=case.cgroup_time_s, cpu_s=max(limits.cpu_s or 0, case.cgroup_time_s))
    try:
        result = sandbox.run(code, limits=run_limits)
    except SandboxError as e:
        return CheckResult(case.name, False, f"the sandbox failed: {e}")
    escaped = case.contained(result, host)
    left = sandbox_processes()
    if escaped is None and left:
        escaped = f"{left} of its processes are still running"
    try:
        alive = sandbox.run("print(6 * 7)", limits=limits)
        if escaped is None and alive.stdout.strip() != "42":
            escaped = f"the sandbox does not run the next program ({alive.problem or alive.stdout!r})"
    except SandboxError as e:
        escaped = escaped or f"the sandbox does not run the next program ({e})"
    last = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() and not result.ok else []
    detail = escaped or (result.problem or "ended normally") + (f" ({last[0][:120]})" if last else "") + (
        f"; {result.leftover_processes} process(es) it left were killed" if result.leftover_processes else "")
    return CheckResult(case.name, escaped is None, detail)


def hostile_checks(sandbox: Sandbox, limits: Limits = CHECK_LIMITS) -> list[CheckResult]:
    """Every ``HOSTILE`` program, checked (``check_hostile``)."""
    with hostile_host(limits.max_output_bytes) as host:
        return [check_hostile(sandbox, case, host, limits) for case in HOSTILE]


# -- the process's sandbox: what the code environments and rewards use ---------------------------------------------------
@dataclass(frozen=True)
class SandboxSettings:
    """How the process's shared sandbox is made (``grpo.sandbox``)."""

    isolation: str = "auto"
    workers: int = 1
    limits: Limits = Limits()
    work_mb: int = 64


_shared: tuple[SandboxSettings, Sandbox] | None = None
_shared_lock = threading.Lock()


def start_shared(settings: SandboxSettings) -> Sandbox:
    """The process's sandbox with ``settings``, started now (a running one with other settings is replaced). Logs which
    isolation is in force. ``SandboxUnavailable`` when the isolation is not available."""
    global _shared
    with _shared_lock:
        if _shared is not None and _shared[0] == settings and not _shared[1].closed:
            return _shared[1]
        sandbox = Sandbox(settings.isolation, settings.workers, settings.limits, settings.work_mb)
        if _shared is not None:  # replaced only once the new one runs
            _shared[1].close()
        _shared = (settings, sandbox)
    lim = asdict(settings.limits)
    logger.info(f"sandbox for model-written code: {sandbox.description}; {sandbox.workers} worker(s); limits {lim}.")
    return sandbox


def shared() -> Sandbox:
    """The process's sandbox (``start_shared``'s; started with the default settings if none was)."""
    with _shared_lock:
        current = _shared
    if current is not None and not current[1].closed:
        return current[1]
    return start_shared(SandboxSettings())


@atexit.register
def _close_shared() -> None:
    if _shared is not None:
        _shared[1].close()
