"""The package's import graph: no cycles, and the layers of the architecture import downwards only.

The graph is read from the source with ``ast``: every ``import`` of an ``oumi_megatron`` module, at module level
or inside a function (a lazy import hides a cycle from Python, not from a reader), except under ``if
TYPE_CHECKING:``. Parent packages imported implicitly are not edges.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"
PACKAGE = "oumi_megatron"

# The layers of the package, lowest first: a module imports its own layer and the ones below it, never one above.
# Every top-level module or package of src/oumi_megatron has a place here (a new one must be given one).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("utils", "errors"),  # helpers and the user-input error: import no other layer
    ("config",),  # the config sections and their problems
    ("model_shape", "bridge_utils", "plugins"),  # offline readers of a model's config, Megatron-Bridge's import, grpo.plugins
    ("data", "state_plan"),  # datasets and the state's size, as the trainer and plan use them: no engine
    ("engine",),  # process groups, the Megatron-Core model, schedules, checkpoints (engine/parallel/layout.py included)
    ("grpo",),  # the GRPO algorithm: losses, advantages
    ("rollout",),  # rollout backends
    ("environments",),  # multi-turn episodes over the rollout backends
    ("trainer",),  # the training loop
    ("validation",),  # checks a whole config: field rules, the layout it resolves, the model's split
    ("plan", "examples"),  # the memory planner (it validates); example content, imported by the CLI alone (test below)
    ("assembly",),  # the composition root: builds the engine, backends and trainer from a config, for the entry points
    ("train", "evaluate", "rollout_view", "cli", "integration", "_oumi_hook", "__main__", "(package)"),  # entry points; the package's
    # __init__ exports lazily (no runtime imports)
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        for target in targets:
            while target and target not in modules:  # ``from pkg.mod import name``: the module pkg.mod
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else "(package)"


def test_the_import_graph_has_no_cycles() -> None:
    graph = _graph()
    assert len(graph) > 50 and graph[f"{PACKAGE}.train"]  # the reader found the package and its imports
    assert _cycles(graph) == []


def test_every_top_level_module_has_a_layer() -> None:
    assert sorted({_layer(m) for m in _graph()} - set(RANK)) == []


def test_layers_import_downwards_only() -> None:
    graph = _graph()
    wrong = sorted(f"{m} ({_layer(m)}) imports {t} ({_layer(t)}, a higher layer)" for m, targets in graph.items()
                   for t in targets if RANK.get(_layer(t), -1) > RANK.get(_layer(m), len(LAYERS)))
    assert wrong == []


def test_examples_stay_outside_the_core() -> None:
    """Example content (oumi_megatron/examples/) is imported by no library module: the CPU demo's task registers
    itself from its config (grpo.plugins); only the CLI's data commands import the arithmetic task and GGUF loading."""
    graph = _graph()
    importers = {m: sorted(t for t in targets if _layer(t) == "examples") for m, targets in graph.items()
                 if _layer(m) != "examples"}
    importers = {m: ts for m, ts in importers.items() if ts}
    assert importers == {f"{PACKAGE}.cli": [f"{PACKAGE}.examples.arithmetic_task", f"{PACKAGE}.examples.code_task",
                                            f"{PACKAGE}.examples.gguf_model"]}
    assert {f"{PACKAGE}.examples.demo_task", f"{PACKAGE}.examples.tiny_models"} <= set(graph)


ENGINE_CONTRACTS = {
    # sub-package -> engine modules it must not import: kernels compute on one rank, parallel coordinates ranks,
    # state moves weights; none of them knows the engine class that composes them, or the builder.
    "engine.kernels": {"engine.engine", "engine.builder", "engine.model", "engine.state"},
    "engine.parallel": {"engine.engine", "engine.builder", "engine.model", "engine.state", "engine.kernels"},
    # the layout resolver runs offline too (validate, plan): of the engine it reads the schedule registry alone
    "engine.parallel.layout": {"engine.engine", "engine.builder", "engine.model", "engine.state", "engine.kernels",
                               "engine.optimizer", "engine.wrappers", "engine.cpu_shims", "engine.parallel.distributed",
                               "engine.parallel.context_parallel", "engine.parallel.module_queue",
                               "engine.parallel.zero_bubble"},
    "engine.state": {"engine.engine", "engine.builder"},
    "engine.engine": {"engine.builder", "engine.state"},
}


def test_engine_sub_packages_keep_their_contracts() -> None:
    def within(module: str, prefix: str) -> bool:
        name = module.removeprefix(f"{PACKAGE}.")
        return name == prefix or name.startswith(prefix + ".")

    graph = _graph()
    assert {f"{PACKAGE}.engine.kernels.attention", f"{PACKAGE}.engine.parallel.schedules", f"{PACKAGE}.engine.parallel.layout",
            f"{PACKAGE}.engine.state.conversion"} <= set(graph)  # the sub-packages exist where the contracts say
    wrong = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                   for sub, banned in ENGINE_CONTRACTS.items()
                   if within(m, sub) and any(within(t, b) for b in banned))
    assert wrong == []


def test_the_reader_sees_lazy_imports_and_skips_type_checking(tmp_path: Path) -> None:
    """The checks above can fail: a cycle through a function-level import is found, TYPE_CHECKING imports are not."""
    (tmp_path / PACKAGE).mkdir()
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "a.py").write_text("from oumi_megatron import b\n")
    (tmp_path / PACKAGE / "b.py").write_text("def f():\n    from oumi_megatron.a import x\n")
    (tmp_path / PACKAGE / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from oumi_megatron import a\n")
    modules = {f"{PACKAGE}.{n}": tmp_path / PACKAGE / f"{n}.py" for n in ("a", "b", "c")}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph == {f"{PACKAGE}.a": {f"{PACKAGE}.b"}, f"{PACKAGE}.b": {f"{PACKAGE}.a"}, f"{PACKAGE}.c": set()}
    assert _cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.b"]]


WEIGHT_SYNC = f"{PACKAGE}.rollout.weight_sync"
BACKENDS = {f"{PACKAGE}.rollout.{m}" for m in ("vllm_backend", "sglang_backend", "ray_fleet", "megatron_backend",
                                                 "vllm_engine", "vllm_common", "registry")}
# modules that vLLM's worker processes import (its worker_extension_cls): torch and the package's network helpers at
# module level, the engine library inside functions
ENGINE_WORKER_MODULES = {f"{WEIGHT_SYNC}.{m}" for m in ("stream", "vllm_stream", "vllm_worker_extension")}


def test_weight_sync_is_one_package_below_the_backends() -> None:
    """rollout/weight_sync/ holds every transport; the backends call it, it calls no backend, and what runs inside an
    engine's worker processes imports torch alone (and the package's network helpers) at module level."""
    graph = _graph()
    assert {f"{WEIGHT_SYNC}.base", f"{WEIGHT_SYNC}.stream", f"{WEIGHT_SYNC}.push"} <= set(graph)
    upward = sorted(f"{m} imports {t}" for m, targets in graph.items() if m.startswith(WEIGHT_SYNC)
                    for t in targets if t in BACKENDS)
    assert upward == []
    heavy = []
    for name in sorted(ENGINE_WORKER_MODULES):
        tree = ast.parse(_modules()[name].read_text())
        for node in tree.body:  # module level only: functions import vLLM where they run
            if isinstance(node, ast.Import):
                roots = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = [node.module or ""]
            else:
                continue
            heavy += [f"{name}: {r}" for r in roots
                      if r.split(".")[0] not in {"torch", PACKAGE, *sys.stdlib_module_names}]
            heavy += [f"{name}: {r}" for r in roots if r.startswith(PACKAGE) and not r.startswith(
                (f"{PACKAGE}.utils.net", WEIGHT_SYNC))]
    assert heavy == []


def test_no_rollout_module_takes_another_modules_private_names() -> None:
    """A backend's private helpers stay its own: what two backends share is a public name of a module both import
    (rollout/vllm_common.py, rollout/engine_gpus.py, rollout/weight_sync/). Private names travel only inside one
    sub-package of rollout/ (decoding/, weight_sync/)."""
    modules = _modules()
    found = []
    for name, path in sorted(modules.items()):
        if not name.startswith(f"{PACKAGE}.rollout"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(PACKAGE):
                continue
            source = node.module or ""
            home = name.rpartition(".")[0] if path.name != "__init__.py" else name
            shared_package = source.rpartition(".")[0] == home and home != f"{PACKAGE}.rollout"
            found += [f"{name} imports {source}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and not shared_package]
    assert found == []
