"""A stand-in for Slurm's commands on one host (Slurm itself is not installed here): ``sbatch``, ``srun``, ``squeue``,
``scontrol`` and ``scancel``, each a small script that runs this file.

It starts real processes the way Slurm would on a cluster of N nodes, all of them this host:
- ``sbatch [options] SCRIPT`` reads the options and the script's ``#SBATCH`` lines (the command line wins), allocates
  ``--nodes`` of the nodes ``install`` was given, and runs the script ONCE, in the background, as the allocation's first
  node: in the folder sbatch was called from, with Slurm's job variables (SLURM_JOB_ID, SLURM_JOB_NODELIST,
  SLURM_NODEID=0, SLURM_CPUS_PER_TASK, ...), its output in ``--output`` (``%j``: the job id; the folder must exist, as
  Slurm needs it to). ``--parsable`` prints the job id alone.
- ``srun [options] COMMAND`` inside a job starts the step's tasks (``--ntasks-per-node``, else ``--ntasks``, else the
  job's tasks, else one per node) as processes of their own, each with its node's and task's variables (SLURM_NODEID,
  SLURM_PROCID, SLURM_LOCALID, SLURMD_NODENAME) and a node-local TMPDIR; it waits for them all and exits with the first
  failure's code (``--kill-on-bad-exit=1``: the other tasks are killed at once).
- ``squeue`` / ``scontrol show job ID`` report the jobs in the formats Oumi's Slurm client parses;
  ``scontrol show hostnames LIST`` expands a node list; ``scancel ID`` kills every process of the job (Slurm's cgroup:
  the job's process tree, frozen first so that no child escapes).

Nodes are loopback addresses (127.0.0.1, 127.0.0.2, ...): one host, but each node's name differs. The state (jobs,
their processes) lives in the folder ``install`` was given. Used by tests/test_two_nodes.py, which submits the Oumi job
script through Oumi's own Slurm launcher.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

COMMANDS = ("sbatch", "srun", "squeue", "scontrol", "scancel")
STATE_ENV = "SLURM_STANDIN_STATE"
# sbatch / srun options that take a value, and flags; another option is refused as Slurm's commands refuse it.
VALUED = {"nodes", "N", "ntasks", "n", "ntasks-per-node", "cpus-per-task", "c", "job-name", "J", "output", "o", "error",
          "e", "gres", "mem", "account", "A", "partition", "p", "time", "t", "qos", "q", "export", "distribution",
          "threads-per-core", "kill-on-bad-exit", "K", "label", "chdir", "D", "gpus-per-node", "nodelist", "w"}
FLAGS = {"exclusive", "parsable", "label", "l", "kill-on-bad-exit", "K"}
LONG = {"N": "nodes", "n": "ntasks", "c": "cpus-per-task", "J": "job-name", "o": "output", "e": "error", "A": "account",
        "p": "partition", "t": "time", "q": "qos", "K": "kill-on-bad-exit", "l": "label", "D": "chdir", "w": "nodelist"}


def install(bin_dir: Path, state: Path, nodes: int) -> dict[str, str]:
    """Writes the commands into ``bin_dir`` for a cluster of ``nodes`` nodes; returns the environment they need
    (PATH first, the state folder)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    (state / "nodes.json").write_text(json.dumps([f"127.0.0.{i + 1}" for i in range(nodes)]))
    for name in COMMANDS:
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" {name} "$@"\n')
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", STATE_ENV: str(state)}


def _state() -> Path:
    return Path(os.environ[STATE_ENV])


def _job_file(job_id: str) -> Path:
    return _state() / "jobs" / f"{job_id}.json"


def read_job(state: Path, job_id: str) -> dict[str, Any]:
    return json.loads((state / "jobs" / f"{job_id}.json").read_text())


def _write_job(job: dict[str, Any]) -> None:
    path = _job_file(job["id"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(job))
    os.replace(tmp, path)


def _fail(command: str, message: str, code: int = 1) -> None:
    print(f"{command}: error: {message}", file=sys.stderr)
    sys.exit(code)


def parse_options(command: str, args: list[str]) -> tuple[dict[str, str], list[str]]:
    """(options by long name, the rest: the script or command and its arguments)."""
    options: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        arg = args[i]
        name, eq, value = arg.lstrip("-").partition("=")
        name = LONG.get(name, name)
        if name in FLAGS and not eq:
            options[name] = "1"
            i += 1
            continue
        if name not in VALUED and name not in FLAGS:
            _fail(command, f"unrecognized option '{arg}'")
        if not eq:
            if i + 1 >= len(args):
                _fail(command, f"option '{arg}' requires an argument")
            value = args[i + 1]
            i += 1
        options[name] = value
        i += 1
    return options, args[i:]


def script_directives(script: str) -> list[str]:
    """The ``#SBATCH`` options at the top of a batch script: sbatch stops reading them at the first command."""
    out: list[str] = []
    for line in script.splitlines()[1:] if script.startswith("#!") else script.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH"):
            out.extend(shlex.split(stripped[len("#SBATCH"):], comments=True))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's node list: ``a,b``, ``node[0-2,5]``."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        match = re.fullmatch(r"(.*)\[([^\]]*)\](.*)", part)
        if not match:
            out.append(part)
            continue
        head, ranges, tail = match.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                out.append(f"{head}{str(n).zfill(len(lo))}{tail}")
    return out


def sbatch(args: list[str]) -> None:
    cli, rest = parse_options("sbatch", args)
    if not rest or not Path(rest[0]).is_file():
        _fail("sbatch", f"Unable to open file {rest[0] if rest else ''}")
    script = Path(rest[0]).resolve()
    directives, _ = parse_options("sbatch", script_directives(script.read_text()))
    options = {**directives, **cli}  # the command line overrides the script's lines
    available = json.loads((_state() / "nodes.json").read_text())
    nodes = int(options.get("nodes", "1"))
    if nodes > len(available):
        _fail("sbatch", "Batch job submission failed: Requested node configuration is not available")
    jobs = _state() / "jobs"
    jobs.mkdir(exist_ok=True)
    job_id = str(1000 + len(list(jobs.glob("*.json"))))
    name = options.get("job-name", script.name)
    output = options.get("output", "slurm-%j.out").replace("%j", job_id).replace("%x", name)
    job = {"id": job_id, "name": name, "user": os.environ.get("USER", "user"), "state": "PENDING", "submit": time.time(),
           "nodes": available[:nodes], "options": options, "script": str(script), "submit_dir": os.getcwd(),
           "output": str(Path(os.getcwd(), output)), "pid": None, "exit_code": None}
    _write_job(job)
    runner = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_run_job", job_id], cwd=os.getcwd(),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)  # the job outlives sbatch, as on a cluster
    print(job_id if "parsable" in options else f"Submitted batch job {job_id}")
    del runner


def _job_env(job: dict[str, Any]) -> dict[str, str]:
    options = job["options"]
    nodes = job["nodes"]
    env = {"SLURM_JOB_ID": job["id"], "SLURM_JOBID": job["id"], "SLURM_JOB_NAME": job["name"],
           "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_NODELIST": ",".join(nodes), "SLURM_JOB_NUM_NODES": str(len(nodes)),
           "SLURM_NNODES": str(len(nodes)), "SLURM_SUBMIT_DIR": job["submit_dir"], "SLURM_SUBMIT_HOST": "localhost",
           "SLURM_CLUSTER_NAME": "standin"}
    for option, variable in (("cpus-per-task", "SLURM_CPUS_PER_TASK"), ("ntasks-per-node", "SLURM_NTASKS_PER_NODE"),
                             ("account", "SLURM_JOB_ACCOUNT"), ("partition", "SLURM_JOB_PARTITION")):
        if option in options:
            env[variable] = options[option]
    if "ntasks" in options:
        env["SLURM_NTASKS"] = options["ntasks"]
    elif "ntasks-per-node" in options:
        env["SLURM_NTASKS"] = str(int(options["ntasks-per-node"]) * len(nodes))
    return env


def _node_env(job: dict[str, Any], node: int) -> dict[str, str]:
    tmp = _state() / "jobs" / job["id"] / f"node{node}" / "tmp"  # node-local scratch, as clusters give each job
    tmp.mkdir(parents=True, exist_ok=True)
    return {"SLURM_NODEID": str(node), "SLURMD_NODENAME": job["nodes"][node], "TMPDIR": str(tmp)}


def _run_job(job_id: str) -> None:
    """The job on its first node: the batch script, once."""
    job = json.loads(_job_file(job_id).read_text())
    output = Path(job["output"])
    if not output.parent.is_dir():  # Slurm cannot open the log: the job fails without one
        job.update(state="FAILED", exit_code=1, reason=f"{output.parent} does not exist")
        _write_job(job)
        return
    job.update(state="RUNNING", pid=os.getpid(), start=time.time())
    _write_job(job)
    env = {**os.environ, **_job_env(job), **_node_env(job, 0), "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    with output.open("ab") as log:
        code = subprocess.call(["/bin/bash", job["script"]], cwd=job["submit_dir"], env=env, stdin=subprocess.DEVNULL,
                               stdout=log, stderr=subprocess.STDOUT)
    job = json.loads(_job_file(job_id).read_text())
    if job["state"] != "CANCELLED":
        job.update(state="COMPLETED" if code == 0 else "FAILED", exit_code=code, end=time.time())
        _write_job(job)


def srun(args: list[str]) -> None:
    options, command = parse_options("srun", args)
    if STATE_ENV not in os.environ or "SLURM_JOB_ID" not in os.environ:
        _fail("srun", "no job allocation: run srun inside a job (sbatch)")
    if not command:
        _fail("srun", "no command to run")
    job = json.loads(_job_file(os.environ["SLURM_JOB_ID"]).read_text())
    nodes = len(job["nodes"])
    if "ntasks-per-node" in options:
        per_node = [int(options["ntasks-per-node"])] * nodes
    else:
        total = int(options.get("ntasks") or os.environ.get("SLURM_NTASKS") or nodes)
        per_node = [total // nodes + (1 if n < total % nodes else 0) for n in range(nodes)]  # block distribution
    tasks: list[tuple[int, int, int]] = []  # (node, local id, global id)
    for node, count in enumerate(per_node):
        tasks.extend((node, local, len(tasks) + local) for local in range(count))
    env_base = {**os.environ, "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(len(tasks)),
                "SLURM_NTASKS": str(len(tasks)), "SLURM_STEP_NODELIST": ",".join(job["nodes"])}
    if "cpus-per-task" in options:
        env_base["SLURM_CPUS_PER_TASK"] = options["cpus-per-task"]
    procs = []
    for node, local, rank in tasks:
        env = {**env_base, **_node_env(job, node), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local)}
        procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
    job.setdefault("steps", []).append({"command": command, "tasks": [list(t) for t in tasks], "options": options,
                                        "pids": [p.pid for p in procs]})
    _write_job(job)
    kill_on_bad_exit = options.get("kill-on-bad-exit", "0") not in ("0", "")
    code = 0
    pending = list(procs)
    while pending:
        for p in list(pending):
            rc = p.poll()
            if rc is None:
                continue
            pending.remove(p)
            if rc != 0 and code == 0:
                code = rc if rc > 0 else 128 - rc
                if kill_on_bad_exit:
                    for other in pending:
                        _kill_tree(other.pid)
        time.sleep(0.2)
    sys.exit(code)


def _kill_tree(pid: int) -> None:
    """Every process below ``pid`` and ``pid`` itself: stopped first (none forks or escapes while the tree is read
    again), then killed."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    seen: dict[int, psutil.Process] = {}
    for _ in range(3):
        try:
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            found = []
        for proc in found:
            if proc.pid not in seen:
                seen[proc.pid] = proc
                try:
                    proc.send_signal(signal.SIGSTOP)
                except psutil.NoSuchProcess:
                    pass
    for proc in seen.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def scancel(args: list[str]) -> None:
    for job_id in args:
        path = _job_file(job_id)
        if not path.is_file():
            _fail("scancel", f"Invalid job id specified: {job_id}")
        job = json.loads(path.read_text())
        job.update(state="CANCELLED", end=time.time())
        _write_job(job)
        if job.get("pid"):
            _kill_tree(int(job["pid"]))


def squeue(args: list[str]) -> None:
    """``squeue --format='%i %j %u %T %V %R'`` (the format Oumi asks for), the jobs not yet finished."""
    for path in sorted((_state() / "jobs").glob("*.json")):
        job = json.loads(path.read_text())
        if job["state"] in ("PENDING", "RUNNING"):
            print(f"{job['id']} {job['name']} {job['user']} {job['state']} {int(job['submit'])} {','.join(job['nodes'])}")


def scontrol(args: list[str]) -> None:
    if args[:2] == ["show", "hostnames"] and len(args) == 3:
        print("\n".join(expand_hostlist(args[2])))
    elif args[:2] == ["show", "job"] and len(args) == 3:
        path = _job_file(args[2])
        if not path.is_file():
            _fail("scontrol", "Invalid job id specified")
        job = json.loads(path.read_text())
        print(f"JobId={job['id']} JobName={job['name']} UserId={job['user']} JobState={job['state']} "
              f"SubmitTime={int(job['submit'])} NodeList={','.join(job['nodes'])} ExitCode={job['exit_code'] or 0}:0")
    else:
        _fail("scontrol", f"this stand-in knows `show hostnames LIST` and `show job ID`, not {' '.join(args)!r}")


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    {"sbatch": sbatch, "srun": srun, "squeue": squeue, "scontrol": scontrol, "scancel": scancel,
     "_run_job": lambda a: _run_job(a[0])}[command](rest)
