"""The sandbox for model-written code (utils/sandbox.py): every hostile program contained, checked from outside (the
host's files, socket, secrets and processes), and programs run as ``python main.py`` runs them."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from oumi_megatron.utils.sandbox import (
    CHECK_LIMITS,
    HOSTILE,
    SECRET_VARIABLE,
    Limits,
    Sandbox,
    SandboxError,
    SandboxUnavailable,
    check_hostile,
    hostile_host,
    sandbox_processes,
)

LIMITS = replace(CHECK_LIMITS, timeout_s=1.0)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    """Two servers, started while the caller's environment holds a secret (no program may see it)."""
    os.environ[SECRET_VARIABLE] = "s3cret-of-the-trainer"
    try:
        with Sandbox("auto", workers=2, limits=LIMITS) as sb:
            yield sb
    finally:
        os.environ.pop(SECRET_VARIABLE)


@pytest.fixture(scope="module")
def host() -> Iterator[dict[str, Any]]:
    with hostile_host(LIMITS.max_output_bytes) as h:
        yield h


def test_this_machine_isolates_with_namespaces(sandbox: Sandbox) -> None:
    """CI runs as root on Linux: the strongest isolation, and the description says what it holds."""
    assert os.geteuid() == 0, "the tests expect root (CI's machines): the namespaces' isolation is what they check"
    assert sandbox.isolation == "namespaces"
    for part in ("mount", "network", "PID", "read-only", "without capabilities", "memory: "):
        assert part in sandbox.description, sandbox.description


@pytest.mark.parametrize("case", HOSTILE, ids=[c.name for c in HOSTILE])
def test_a_hostile_program_is_contained(sandbox: Sandbox, host: dict[str, Any], case: Any) -> None:
    """Its result says what it did, nothing outside changed, no process is left, and the sandbox runs the next one."""
    result = check_hostile(sandbox, case, host, LIMITS)
    assert result.contained, f"{case.name}: {result.detail}"
    assert not host["written"]() and not host["accepted"]() and sandbox_processes() == 0


def test_a_program_runs_as_python_runs_a_file(sandbox: Sandbox) -> None:
    code = ("import os, sys\nprint(__name__, sys.argv[0], os.getcwd(), sorted(os.environ))\nprint(input().upper())\n"
            "print('to stderr', file=sys.stderr)\nprint(os.listdir('.'))\nopen('left.txt', 'w').write('x')\nsys.exit(3)")
    r = sandbox.run(code, stdin="hello\n")
    assert r.exit_code == 3 and r.signal is None and not r.timed_out and r.problem == "it exited with status 3"
    lines = r.stdout.splitlines()
    assert lines[0] == "__main__ /sandbox/work/main.py /sandbox/work ['HOME', 'LANG', 'PATH', 'PYTHONIOENCODING', 'TMPDIR']"
    assert lines[1:] == ["HELLO", "['main.py']"] and r.stderr == "to stderr\n"
    again = sandbox.run("import os\nprint(os.listdir('.'))")
    assert again.ok and again.stdout == "['main.py']\n"  # a fresh folder: the last program's file is gone
    err = sandbox.run("def f():\n    return 1 / 0\nf()")
    assert err.exit_code == 1 and err.stderr.startswith("Traceback (most recent call last):\n  File \"/sandbox/work/main.py\"")
    assert "ZeroDivisionError: division by zero" in err.stderr and "sandbox_server" not in err.stderr
    syntax = sandbox.run("def f(:\n")
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr and "Traceback" not in syntax.stderr
    draws = {sandbox.run("import random\nprint(random.random())").stdout for _ in range(3)}
    assert len(draws) == 3  # each program's generator is its own, not the pre-started interpreter's


def test_programs_run_on_every_server_at_once_and_come_back_in_order(sandbox: Sandbox) -> None:
    started = time.perf_counter()
    results = sandbox.run_many([f"import time\ntime.sleep(0.3)\nprint({i})" for i in range(6)])
    took = time.perf_counter() - started
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]  # type: ignore[union-attr]
    assert 0.85 < took < 1.6, took  # 3 rounds on 2 servers, not 6


def test_a_server_that_dies_is_replaced(sandbox: Sandbox) -> None:
    """The sandbox itself failing is a SandboxError for that program; the next one runs on a fresh server."""
    victim = sandbox._workers[0]
    taken = [sandbox._idle.get() for _ in range(sandbox.workers)]  # hold both, so the next run gets the victim
    victim.proc.kill()
    victim.proc.wait()
    for worker in taken:
        sandbox._idle.put(worker)
    outcomes = [sandbox.run_many(["print(1)"] * 2)]
    outcomes.append(sandbox.run_many(["print(2)"] * 2))
    errors = [r for batch in outcomes for r in batch if isinstance(r, SandboxError)]
    assert len(errors) == 1 and "the sandbox server" in str(errors[0])  # exited, or gone when the request was sent
    assert all(r.stdout == "2\n" for r in outcomes[1])  # type: ignore[union-attr]
    assert victim not in sandbox._workers and len(sandbox._workers) == 2


def test_what_the_machine_lacks_is_refused_with_the_fixes() -> None:
    if shutil.which("bwrap") is None:
        with pytest.raises(SandboxUnavailable, match=r"grpo.sandbox.isolation: .* isolation 'bwrap' .*bubblewrap is not "
                                                     r"installed.*limits_unsafe to run such code with resource limits only"):
            Sandbox("bwrap")
    else:  # pragma: no cover - machines with bubblewrap
        with Sandbox("bwrap") as sb:
            assert sb.run("print(1)").stdout == "1\n"
    prefix = os.path.realpath(sys.base_prefix)
    searchable = all(os.stat(p).st_mode & 0o001 for p in [prefix, *map(str, Path(prefix).parents)])
    if searchable:  # pragma: no cover - an interpreter every user can read
        with Sandbox("limits_unsafe") as sb:
            assert sb.description.startswith("limits_unsafe: ") and sb.run("print(1)").stdout == "1\n"
    else:  # this machine's pyenv lives under /root (0700): a uid of the programs' own cannot read it
        with pytest.raises(SandboxUnavailable, match="cannot reach this interpreter's standard library"):
            Sandbox("limits_unsafe")
    with pytest.raises(ValueError, match="grpo.sandbox.isolation: unknown value 'docker'"):
        Sandbox("docker")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Limits(timeout_s=0)


def test_a_closed_sandbox_leaves_nothing_behind() -> None:
    """Its servers' processes, their new roots' mount points on the host and their memory cgroups are gone."""
    sb = Sandbox("auto", workers=2, limits=LIMITS)
    sb.run("import os\nif os.fork() == 0:\n    import time\n    time.sleep(60)")
    kept = [(w.proc, w.folder, w.cgroup.folder if w.cgroup else None) for w in sb._workers]
    sb.close()
    for proc, folder, cgroup in kept:
        assert proc.poll() is not None and not os.path.exists(folder) and (cgroup is None or not os.path.exists(cgroup))
    assert sandbox_processes() == 0
