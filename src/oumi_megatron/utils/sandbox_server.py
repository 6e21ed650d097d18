"""The sandbox's server: one pre-started Python interpreter that runs programs for utils/sandbox.py, one at a time.

utils/sandbox.py starts it as ``python -I -S sandbox_server.py`` (no site-packages, no environment variables), sends one
setup message and then one message per program, over stdin and stdout (4-byte big-endian length, then JSON). It
imports nothing but the standard library: it is not imported by the package, it is run.

Isolation (the setup message's ``isolation``):
- ``namespaces`` (root): the server unshares mount, network, PID, IPC and UTS namespaces and forks; the child is PID 1
  of the new PID namespace and builds a new root: a read-only tmpfs holding read-only binds of the system's library
  folders and the interpreter's prefix, the devices null / zero / random / urandom, and ``/sandbox``, a size-limited
  tmpfs (nosuid, nodev, noexec) for the working folders; ``pivot_root`` onto it and the host's tree unmounted. There
  is no /proc, no /tmp, no /home: only what the interpreter needs. The network namespace has only a loopback that is
  down. Programs run as a uid of their own (``uid``, no groups, no capabilities, no new privileges), so the process
  limit counts their processes alone and they cannot signal or trace the server.
- ``bwrap``: bubblewrap built the same namespaces and root before this process started (``--as-pid-1``); programs
  run as the server's own unprivileged uid.
- ``limits``: none of that; limits, a fresh folder in the host's temporary folder, a cleared environment, and the
  reaping below. Files of the host are readable and the network is reachable: utils/sandbox.py starts it only when
  the user opted out by name.

Each program runs in a fresh fork of this server (the pre-started interpreter: its preloaded modules are shared, no
state of one program reaches the next) with its own session, a fresh working folder (removed afterwards), stdin from a
pipe, stdout and stderr into files capped by RLIMIT_FSIZE, and RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_NOFILE and
RLIMIT_CORE. At the wall-time limit the program is killed; when it has ended, every process left is killed (the PID
namespace's init kills all of them with ``kill(-1)``; in ``limits`` the server is a child subreaper and kills its
descendants), so a fork bomb, a daemon or a thread that outlives the program is gone before the reply.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import select
import signal
import stat
import struct
import sys
import time
from typing import Any

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32", "/sbin")
"""Bound read-only into the new root (or recreated as the symbolic links they are, on merged-/usr systems)."""
DEVICES = ("null", "zero", "random", "urandom")
PIPE_BYTES = 1 << 20
"""The most stdin a program takes (the most a pipe holds without a privileged F_SETPIPE_SZ)."""
F_SETPIPE_SZ = 1031
WORK_ROOT = "/sandbox"
"""The tmpfs that holds the working folder (namespaces, bwrap)."""
PRELOAD = ("math", "re", "json", "collections", "itertools", "functools", "heapq", "bisect", "string", "typing",
           "random", "traceback", "io", "types", "copy", "operator", "fractions", "decimal", "statistics", "hashlib",
           "dataclasses", "enum", "datetime", "textwrap", "struct")
"""Imported once here: every program's fork has them (most programs import a few; forks share the pages)."""

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                       data and data.encode()), f"mount {source or ''} on {target}")


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl {option}")


# -- the protocol -------------------------------------------------------------------------------------------------------
def _read_exact(n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(0, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_message() -> dict[str, Any] | None:
    """The next message from utils/sandbox.py; None at the end of stdin (the caller went away)."""
    head = _read_exact(4)
    if head is None:
        return None
    body = _read_exact(struct.unpack(">I", head)[0])
    return None if body is None else json.loads(body)


def write_message(message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(1, data):]


# -- the namespaces' root -----------------------------------------------------------------------------------------------
def _bind_read_only(source: str, root: str) -> None:
    target = root + source
    if os.path.islink(source):  # /lib -> usr/lib on merged-/usr systems: the link itself
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()  # noqa: SIM115 - a mount point
    _mount(source, target, None, MS_BIND)  # not MS_REC: mounts below the source stay out
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(new_root: str, prefixes: list[str], work_mb: int) -> list[str]:
    """The namespaces' new root on ``new_root`` (an empty folder the caller made), pivoted onto; what it holds."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    bound: list[str] = []
    for source in (*SYSTEM_DIRS, *prefixes):
        covered = any(source == b or source.startswith(b.rstrip("/") + "/") for b in bound)
        if os.path.lexists(source) and not covered:
            _bind_read_only(source, new_root)
            bound.append(source)
    os.makedirs(new_root + "/dev")
    for name in DEVICES:
        path = new_root + "/dev/" + name
        open(path, "w").close()  # noqa: SIM115 - a mount point
        _mount("/dev/" + name, path, None, MS_BIND)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)
    os.makedirs(new_root + WORK_ROOT)
    _mount("tmpfs", new_root + WORK_ROOT, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"size={work_mb}m,nr_inodes={work_mb * 256},mode=711")  # files count too: 256 a MiB
    old = new_root + "/.old_root"
    os.makedirs(old)
    _check(_libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], new_root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old_root", MNT_DETACH), "umount the host's root")
    os.rmdir("/.old_root")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return bound


def enter_namespaces(setup: dict[str, Any]) -> str:
    """``namespaces``: this process becomes PID 1 of new namespaces with the new root (the parent that forked it waits
    and exits with it); the isolation's description."""
    os.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS)
    child = os.fork()
    if child:  # the outer process: only waits, so that the caller's pipe ends when the server does
        os.close(0)
        os.close(1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the outer process is killed: so is the whole namespace
    bound = build_root(setup["new_root"], setup["prefixes"], setup["work_mb"])
    return ("namespaces: mount (read-only root of " + ", ".join(bound) + "; /dev of " + ", ".join(DEVICES)
            + f"; a {setup['work_mb']} MiB tmpfs for the working folder; no /proc, /tmp or home), network (no interface "
            f"up), PID, IPC, UTS; programs run as uid {setup['uid']} without capabilities or new privileges")


# -- one program --------------------------------------------------------------------------------------------------------
class Program:
    """One run of a program: its folder, its io files, its limits (a ``run`` message)."""

    def __init__(self, message: dict[str, Any], setup: dict[str, Any]) -> None:
        self.message, self.setup = message, setup
        base = WORK_ROOT if setup["isolation"] != "limits" else setup["work_parent"]
        self.work = os.path.join(base, "work")
        self.io = os.path.join(base, "io")

    def prepare(self) -> None:
        for path in (self.work, self.io):
            remove_tree(path)
        uid, gid = self.setup["uid"], self.setup["gid"]
        os.mkdir(self.io, 0o700)
        os.mkdir(self.work, 0o700)
        if uid is not None:
            os.chown(self.work, uid, gid)
        self.main = os.path.join(self.work, "main.py")
        _write(self.main, self.message.pop("code"), uid, gid)
        # stdin through a pipe, written whole now: read once, it cannot be read again (a key the caller passes there,
        # grpo/code_tests.py's, is in no file and, popped here, in none of this server's objects the fork inherits)
        data = (self.message.pop("stdin", None) or "").encode()
        if len(data) > PIPE_BYTES:
            raise ValueError(f"the program's stdin is {len(data)} bytes; the sandbox takes at most {PIPE_BYTES}")
        self.stdin, writer = os.pipe()
        if data:
            fcntl.fcntl(writer, F_SETPIPE_SZ, max(len(data), 4096))
            os.write(writer, data)
        os.close(writer)

    def child(self) -> None:
        """The forked child: limits, identity, folder, environment, then the program; never returns."""
        try:
            m, s = self.message, self.setup
            os.setsid()
            fds = [self.stdin,
                   os.open(os.path.join(self.io, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                   os.open(os.path.join(self.io, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)]
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.closerange(3, 1 << 16)
            cpu = max(1, int(m["cpu_s"] + 0.999))
            limits = {resource.RLIMIT_CPU: (cpu, cpu + 1), resource.RLIMIT_AS: (m["memory_mb"] << 20,) * 2,
                      resource.RLIMIT_FSIZE: (m["max_output_bytes"],) * 2, resource.RLIMIT_CORE: (0, 0),
                      resource.RLIMIT_NOFILE: (256, 256), resource.RLIMIT_NPROC: (m["max_processes"],) * 2}
            for kind, value in limits.items():
                resource.setrlimit(kind, value)
            if s["uid"] is not None:
                os.setgroups([])
                os.setgid(s["gid"])
                os.setuid(s["uid"])
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            os.chdir(self.work)
            os.umask(0o077)
            os.environ.clear()
            os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": self.work, "TMPDIR": self.work,
                               "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"})
        except BaseException as e:  # noqa: BLE001 - the setup failed: say so on the program's stderr
            os.write(2, f"sandbox: the program could not be started: {type(e).__name__}: {e}\n".encode())
            os._exit(125)
        os._exit(run_main(self.main))

    def finish(self, status: int, timed_out: bool, wall_s: float, cpu_s: float, leftover: int) -> dict[str, Any]:
        cap = self.message["max_output_bytes"]
        out: dict[str, Any] = {"exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
               "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
               "timed_out": timed_out, "wall_s": wall_s, "cpu_s": cpu_s, "leftover_processes": leftover}
        for name in ("stdout", "stderr"):
            path = os.path.join(self.io, name)
            data = b""
            if os.path.exists(path):
                with open(path, "rb") as f:
                    data = f.read(cap + 1)
            out[name] = data[:cap].decode("utf-8", errors="replace")
            out[f"{name}_truncated"] = len(data) >= cap
        for path in (self.work, self.io):
            remove_tree(path)
        return out


def _write(path: str, text: str, uid: int | None, gid: int | None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    if uid is not None:
        os.chown(path, uid, gid)  # type: ignore[arg-type]


def remove_tree(path: str) -> None:
    """``path`` and everything below it, whatever the program left there: any modes, no link followed, a tree of any
    depth (each folder is moved up beside ``path`` before it is emptied: no recursion, short paths, few descriptors)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    parent, moved = os.path.dirname(path), 0
    todo = [path]
    while todo:
        folder = todo.pop()
        os.chmod(folder, 0o700)
        for entry in os.scandir(folder):
            if entry.is_dir(follow_symlinks=False):
                moved += 1
                flat = os.path.join(parent, f".removing-{moved}")
                os.rename(entry.path, flat)
                todo.append(flat)
            else:
                os.unlink(entry.path)
        os.rmdir(folder)


def run_main(path: str) -> int:
    """Runs ``path`` as ``python path`` would, in this (forked, limited) interpreter; the exit status."""
    import builtins
    import io
    import traceback
    import types

    # fresh streams on the program's files (nothing the server buffered comes along), as ``python`` makes them
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8",  # type: ignore[misc]
                                                 errors="replace")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False),  # type: ignore[misc]
                                                   encoding="utf-8", errors="backslashreplace")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False),  # type: ignore[misc]
                                                   encoding="utf-8", errors="backslashreplace", line_buffering=True)
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(path))
    if "random" in sys.modules:  # a fork shares the server's generator state: every program would draw the same
        sys.modules["random"].seed()
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)  # noqa: S102 - the sandboxed program, in its own process
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # noqa: BLE001 - as Python reports an uncaught exception, without this frame
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001, S110 - a closed or full stream: what was written stays
            pass
    return code & 0xFF  # os._exit by the caller: threads the program left do not keep it alive


def _kill_leftovers(isolation: str) -> int:
    """Kills every process the program left and reaps them; how many there were."""
    killed = 0
    while True:
        if isolation == "limits":  # a child subreaper: the program's descendants are this server's children now
            for pid in _children():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:  # PID 1 of the namespace: everything but itself
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return killed
        killed += 1


def _children() -> list[int]:
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def run_program(program: Program) -> dict[str, Any]:
    m = program.message
    program.prepare()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        program.child()
    os.close(program.stdin)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    timed_out = not poller.poll(max(1, int(m["timeout_s"] * 1000)))
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(pidfd)
    timed_out = timed_out or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU)  # the CPU time limit
    wall = time.perf_counter() - started
    leftover = _kill_leftovers(program.setup["isolation"])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return program.finish(status, timed_out, wall, cpu, leftover)


def serve(setup: dict[str, Any]) -> None:
    isolation = setup["isolation"]
    if isolation == "namespaces":
        description = enter_namespaces(setup)
    elif isolation == "bwrap":
        if os.getpid() != 1:
            raise RuntimeError("bubblewrap did not make the server PID 1 of its namespace (--as-pid-1)")
        who = f"uid {setup['uid']} without capabilities" if setup["uid"] is not None else "the server's unprivileged uid"
        description = ("bwrap: bubblewrap's mount (read-only root of the system's folders and the interpreter; a "
                       f"{setup['work_mb']} MiB tmpfs for the working folder), network, PID, IPC, UTS namespaces; programs "
                       f"run as {who}")
    else:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the caller is killed: so is this server (its programs are reaped)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        description = ("limits only (no namespaces): the program can read the machine's files and reach the network; "
                       "rlimits, a fresh folder, a cleared environment, and its processes reaped")
    _prctl(PR_SET_DUMPABLE, 0)  # the programs (same uid under bwrap) cannot trace this server or read its memory
    for name in PRELOAD:
        __import__(name)
    sys.executable = setup["executable"]  # a program that starts `sys.executable` gets the interpreter the root holds
    write_message({"ready": True, "description": description})
    while True:
        message = read_message()
        if message is None:
            return
        try:
            reply = run_program(Program(message, setup))
        except Exception as e:  # noqa: BLE001 - this request failed (not the program); the server serves the next
            reply = {"error": f"{type(e).__name__}: {e}"}
        write_message(reply)


def main() -> None:
    setup = read_message()
    if setup is None:
        return
    try:
        serve(setup)
    except Exception as e:  # noqa: BLE001 - the caller reports why the sandbox could not start
        write_message({"ready": False, "error": f"{type(e).__name__}: {e}"})
        sys.exit(1)


if __name__ == "__main__":
    main()
