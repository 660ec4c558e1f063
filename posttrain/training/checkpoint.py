"""Atomic, verifiable checkpoints.

``run_dir/checkpoints/step_000040/`` holds

- the model (``save_pretrained``, safetensors) and tokenizer, so the directory also loads with
  ``from_pretrained``;
- ``<name>.safetensors`` for each extra module (a value model, a value head);
- ``optimizer.pt``, ``scheduler.pt`` (state dicts);
- ``trainer_state.json``: ``{"step": 40, **trainer_state}``; the caller's dict holds the epoch,
  data-order position, running metrics, the run's config and a ``fingerprint``
  (:func:`posttrain.training.setup.fingerprint`: model, algorithm, parameter count);
- ``extra_state.pt``: tensors and containers of them that are not module weights (e.g. dynamic
  sampling's surplus groups), loaded back with ``load_extra_state``;
- ``rng.pt``: Python ``random``, NumPy, torch CPU and (when present) CUDA generator states;
- ``manifest.json``, written last: every other file's size and sha256.

Decisions:

1. A save writes into ``checkpoints/.tmp-step_000040-<pid>/``, fsyncs every file and the
   manifest, then renames the directory into place and fsyncs ``checkpoints/``. A crash leaves
   either no ``step_*`` directory or a complete one; leftover ``.tmp-*`` directories are never
   read and are deleted by the next save.
2. A directory counts as a checkpoint only if its manifest exists and every listed file has the
   listed size (cheap); ``verify=True`` also checks sha256 (reads every byte). ``load_checkpoint``
   verifies hashes by default: a resume is rare, a silently corrupt one is expensive.
3. Saving step N deletes checkpoints of steps > N: they belong to a timeline abandoned by
   resuming from an older checkpoint, and ``latest_checkpoint`` must not pick them up.
4. Loading asks for what it restores and must find it; what it is not asked for is ignored (a
   checkpoint with ``optimizer.pt`` loads into a model alone for evaluation). Model weights are
   loaded with strict keys: a missing key is allowed only when it is tied to (shares memory
   with) a loaded one, which is how ``save_pretrained`` stores tied embeddings.
5. RNG: CUDA states are restored for as many devices as both runs have; bitwise-equal
   continuation needs the same hardware anyway. One ``rng.pt`` per checkpoint: the process that
   saves is the one whose generators are restored.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_model
from torch import Tensor, nn

from posttrain.data.images import processor_of
from posttrain.models.lora import is_lora
from posttrain.parallel import fsdp

CHECKPOINTS_DIR = "checkpoints"
FINAL_MODEL_DIR = "final_model"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
EXTRA_STATE = "extra_state.pt"
_STEP_DIR = re.compile(r"step_(\d+)")
_HASH_CHUNK = 1 << 20
_NEARLY_FULL = 1 << 20  # free bytes under which a failed write is taken for a full file system

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupt, or was made by a different model or algorithm."""


STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG})
"""What a file system refuses a write with: full, over quota, not writable, read-only, file too large."""


class StorageError(OSError):
    """A checkpoint or model could not be written; the message names the path, the bytes it needs and the
    bytes free, and the checkpoint that is still whole."""

    def __str__(self) -> str:
        return str(self.strerror)


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: nn.Module,
    tokenizer: Any | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    trainer_state: Mapping[str, Any],
    extra_modules: Mapping[str, nn.Module] | None = None,
    extra_state: Mapping[str, Any] | None = None,
    keep_last: int | None = 2,
    model_state: Mapping[str, Tensor] | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically and return its directory. ``model`` is a
    ``transformers`` model; ``extra_modules`` are saved as ``<name>.safetensors``. Afterwards at
    most ``keep_last`` checkpoints remain (``None``: all), the new one always among them.
    ``model_state``/``optimizer_state``, when given, are written instead of the model's and the
    optimizer's own state dicts (FSDP: the full tensors, gathered beforehand by every process)."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be None or >= 1, got {keep_last}")
    if trainer_state.get("step", step) != step:
        raise ValueError(f"trainer_state['step'] is {trainer_state['step']} but the checkpoint is for step {step}")
    final = checkpoint_path(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dirs(final.parent.glob(".tmp-*"))

    def write(directory: Path) -> None:
        _save_model(directory, model, tokenizer, model_state)
        for name, module in (extra_modules or {}).items():
            save_model(module, str(directory / f"{name}.safetensors"))
        if optimizer is not None:
            torch.save(optimizer_state or optimizer.state_dict(), directory / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), directory / "scheduler.pt")
        torch.save(_rng_state(), directory / "rng.pt")
        torch.save(dict(extra_state or {}), directory / EXTRA_STATE)
        (directory / TRAINER_STATE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))

    _write_atomically(final, write)
    _prune(final.parent, step, keep_last)
    return final


def save_final_model(run_dir: str | os.PathLike, model: nn.Module, tokenizer: Any | None = None,
                     model_state: Mapping[str, Tensor] | None = None, name: str = FINAL_MODEL_DIR) -> Path:
    """Write ``run_dir/final_model/`` (or ``run_dir/NAME/``: ``from_pretrained``-loadable, with a manifest)
    atomically, replacing an older one; ``model_state`` as in :func:`save_checkpoint`."""
    final = Path(run_dir) / name
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dirs(final.parent.glob(f".tmp-{name}-*"))
    _write_atomically(final, lambda directory: _save_model(directory, model, tokenizer, model_state))
    return final


def latest_checkpoint(run_dir: str | os.PathLike, *, verify: bool = False) -> Path | None:
    """The newest complete checkpoint of the run, or None. Incomplete or corrupt ones are
    skipped with a warning; ``verify=True`` checks sha256 as well as sizes."""
    for _, path in reversed(_step_dirs(Path(run_dir) / CHECKPOINTS_DIR)):
        try:
            verify_checkpoint(path, hashes=verify)
        except CheckpointError as error:
            logger.warning("skipping checkpoint: %s", error)
            continue
        return path
    return None


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    extra_modules: Mapping[str, nn.Module] | None = None,
    expected_fingerprint: Mapping[str, Any] | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Restore model weights, the given optimizer/scheduler/extra modules and the RNG states from
    a checkpoint directory; return its trainer state. Nothing is modified unless the manifest
    verifies and the fingerprint matches."""
    path = Path(path)
    verify_checkpoint(path, hashes=verify)
    state = json.loads((path / TRAINER_STATE).read_text())
    if expected_fingerprint is not None:
        _check_fingerprint(path, state.get("fingerprint"), expected_fingerprint)
    _load_model_weights(model, path)
    for name, module in (extra_modules or {}).items():
        _load_strict(module, load_file(_existing(path, f"{name}.safetensors")), path / f"{name}.safetensors")
    if optimizer is not None:
        saved = torch.load(_existing(path, "optimizer.pt"), map_location="cpu", weights_only=True)
        optimizer.load_state_dict(fsdp.load_optimizer_state(optimizer, saved))  # FSDP: each process its shards
    if scheduler is not None:
        _continue_schedule(scheduler, torch.load(_existing(path, "scheduler.pt"), map_location="cpu", weights_only=True))
    _set_rng_state(torch.load(_existing(path, "rng.pt"), weights_only=True))
    return state


def checkpoint_step(path: str | os.PathLike) -> int:
    """The training step a checkpoint directory was saved at (from its ``step_N`` name)."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    if match is None:
        raise CheckpointError(f"{path} is not a checkpoint directory (step_N)")
    return int(match.group(1))


def _continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, saved: Mapping[str, Any]) -> None:
    """Take the saved scheduler's step count and set each group's rate from this run's schedule.

    The saved state also holds the rate the saved run's own schedule gave its next step. A run
    resumed with more steps (``--resume DIR --max-steps N``) or another learning rate has another
    schedule: its rates come from the base rates and multipliers it was built with, at the loaded
    step. (Loading the saved rates made an extended linear or cosine run take its next step at 0.)
    """
    scheduler.last_epoch = saved["last_epoch"]
    rates = [base * rule(scheduler.last_epoch) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, base, rate in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, rates):
        group["initial_lr"], group["lr"] = base, rate
    scheduler._last_lr = rates


def load_extra_state(path: str | os.PathLike) -> dict[str, Any]:
    """The ``extra_state`` mapping saved with the checkpoint (empty for checkpoints without one)."""
    file = Path(path) / EXTRA_STATE
    return torch.load(file, map_location="cpu", weights_only=True) if file.exists() else {}


def verify_checkpoint(path: str | os.PathLike, *, hashes: bool = True) -> None:
    """Raise CheckpointError unless every file in the manifest has its recorded size (and sha256)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"incomplete checkpoint {path}: {MANIFEST} is missing (the save did not finish)")
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (json.JSONDecodeError, KeyError) as error:
        raise CheckpointError(f"corrupt checkpoint {path}: {MANIFEST} is unreadable ({error})") from error
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"corrupt checkpoint {path}: file {name} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"corrupt checkpoint {path}: file {name} has {size} bytes, manifest says {entry['size']}"
            )
        if hashes and (digest := _sha256(file)) != entry["sha256"]:
            raise CheckpointError(
                f"corrupt checkpoint {path}: file {name} has sha256 {digest}, manifest says {entry['sha256']}"
            )


# --- writing -------------------------------------------------------------------------------


def _save_model(directory: Path, model: nn.Module, tokenizer: Any | None,
                state: Mapping[str, Tensor] | None = None) -> None:
    # save_original_format=False keeps the model's own parameter names (transformers 5 would
    # otherwise convert some architectures back to their hub layout), so strict loading works.
    model.save_pretrained(directory, save_original_format=False, **({"state_dict": dict(state)} if state else {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
        processor = processor_of(tokenizer)
        if processor is not None:  # a vision-language model's: its image processor and chat template with it
            processor.save_pretrained(directory)


def _write_atomically(final: Path, write: Callable[[Path], None]) -> None:
    """Run ``write`` into a temporary sibling of ``final``, add the manifest, rename into place."""
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    replaced = final.with_name(f".tmp-{final.name}-{os.getpid()}-replaced")
    _check_free_space(final)
    try:
        tmp.mkdir()
        write(tmp)
        _write_manifest(tmp)
        if final.exists():  # same step saved again: move the old copy aside, never merge into it
            os.rename(final, replaced)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException as error:
        written, code = _bytes_under(tmp), _storage_errno(error, final.parent)
        if replaced.exists() and not final.exists():
            os.rename(replaced, final)
        shutil.rmtree(tmp, ignore_errors=True)
        if code is not None:
            raise _storage_error(final, code, getattr(error, "filename", None), written) from error
        raise
    shutil.rmtree(replaced, ignore_errors=True)


def _storage_errno(error: BaseException, directory: Path) -> int | None:
    """The file system's refusal behind a failed write, or None for any other failure. torch.save and
    safetensors do not raise OSError on a full disk (a RuntimeError "unexpected pos", a SafetensorError
    "... (os error 28)"): their message, then the free space, tell it."""
    if isinstance(error, OSError):
        return error.errno if error.errno in STORAGE_ERRNOS else None
    if not isinstance(error, Exception):
        return None
    found = re.search(r"os error (\d+)", str(error))
    if found and int(found.group(1)) in STORAGE_ERRNOS:
        return int(found.group(1))
    try:
        return errno.ENOSPC if shutil.disk_usage(directory).free < _NEARLY_FULL else None
    except OSError:
        return None


def _check_free_space(final: Path) -> None:
    """Refuse, before writing anything, a checkpoint that cannot fit: one as large as the newest checkpoint
    beside it needs that much free space (older ones are pruned only after the new one is whole)."""
    if final.parent.name != CHECKPOINTS_DIR:
        return
    previous = latest_checkpoint(final.parent.parent)
    if previous is None:
        return
    needed, free = _bytes_under(previous), shutil.disk_usage(final.parent).free
    if free < needed:
        raise _storage_error(final, errno.ENOSPC, None, 0)


def _storage_error(final: Path, code: int, filename: str | None, written: int) -> StorageError:
    """What a refused write says: where, why, how many bytes it needs and has, and what is still whole."""
    previous = latest_checkpoint(final.parent.parent) if final.parent.name == CHECKPOINTS_DIR else None
    if previous is not None and previous != final:
        needed = f"about {_size(_bytes_under(previous))} (the size of {previous.name})"
        kept = f"the previous checkpoint {previous} is whole"
    else:
        needed, kept = f"more than the {_size(written)} written before the failure", "nothing was replaced"
    try:
        free = f"{_size(shutil.disk_usage(final.parent).free)} free there"
    except OSError:
        free = "its free space unknown"
    return StorageError(code, f"cannot write {final}: {os.strerror(code)} ({filename or final}); it "
                        f"needs {needed}, {free}. {kept}; free space or fix the permissions, then resume the run")


def _bytes_under(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def _write_manifest(directory: Path) -> None:
    files = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = file.relative_to(directory).as_posix()
        files[name] = {"size": file.stat().st_size, "sha256": _sha256(file, fsync=True)}
    for subdirectory in (p for p in directory.rglob("*") if p.is_dir()):
        _fsync_dir(subdirectory)
    with (directory / MANIFEST).open("w") as out:
        json.dump({"files": files}, out, indent=2)
        out.flush()
        os.fsync(out.fileno())
    _fsync_dir(directory)


def _sha256(file: Path, *, fsync: bool = False) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``step_*`` directories under ``root``, oldest first (by step number, not name)."""
    if not root.is_dir():
        return []
    found = ((_STEP_DIR.fullmatch(p.name), p) for p in root.iterdir() if p.is_dir())
    return sorted((int(match.group(1)), p) for match, p in found if match)


def _prune(root: Path, step: int, keep_last: int | None) -> None:
    others = [(s, p) for s, p in _step_dirs(root) if s != step]
    newer = [p for s, p in others if s > step]
    for path in newer:
        logger.warning("deleting %s: newer than the step %d just saved (abandoned by a resume)", path, step)
    older = [p for s, p in others if s < step]
    drop = older[: max(0, len(older) - (keep_last - 1))] if keep_last is not None else []
    _remove_dirs(newer + drop)


def _remove_dirs(paths: Any) -> None:
    for path in paths:
        shutil.rmtree(path)


# --- reading -------------------------------------------------------------------------------


def _existing(path: Path, name: str) -> Path:
    if not (path / name).is_file():
        raise CheckpointError(f"checkpoint {path} has no {name}")
    return path / name


def _read_model_weights(path: Path) -> dict[str, Tensor]:
    """The tensors of ``model.safetensors``, or of every shard listed in its index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = [_existing(path, "model.safetensors").name]
    tensors: dict[str, Tensor] = {}
    for shard in shards:
        tensors.update(load_file(path / shard))
    return tensors


def _load_model_weights(model: nn.Module, path: Path) -> None:
    """Full weights into a plain model; under LoRA (a ``peft`` model, which ``save_pretrained``
    writes as ``adapter_model.safetensors`` only) the adapter weights, checked key by key the same
    way: the frozen base weights come from the model the run was started from."""
    if not is_lora(model):
        _load_strict(model, _read_model_weights(path), path)
        return
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    source = path / "adapter_model.safetensors"
    tensors = load_file(_existing(path, source.name))
    _check_keys(tensors.keys(), get_peft_model_state_dict(model).keys(), source, "LoRA adapters")
    result = set_peft_model_state_dict(model, tensors)
    if result.unexpected_keys:  # peft renames keys: a key it could not place would be lost silently
        raise CheckpointError(f"{source}: peft could not place adapter weights {sorted(result.unexpected_keys)[:5]}")


def _check_keys(found: Any, expected: Any, source: Path, what: str) -> None:
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match the {what} it is loaded into: "
            f"missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )


def _load_strict(module: nn.Module, tensors: Mapping[str, Tensor], source: Path) -> None:
    """Load ``tensors`` into ``module``, failing (before any change) on a missing or unexpected
    key; a missing key is fine when its parameter is tied to a loaded one."""
    own = module.state_dict()
    loaded = {(own[k].data_ptr(), own[k].shape) for k in tensors.keys() & own.keys()}
    tied = {k for k in own.keys() - tensors.keys() if (own[k].data_ptr(), own[k].shape) in loaded}
    _check_keys(tensors.keys(), own.keys() - tied, source, type(module).__name__)
    module.load_state_dict(fsdp.load_state(own, tensors), strict=False)  # FSDP: each process keeps its shards


def _check_fingerprint(path: Path, stored: Mapping[str, Any] | None, expected: Mapping[str, Any]) -> None:
    stored = stored or {}
    differing = [k for k in dict.fromkeys([*stored, *expected]) if stored.get(k) != expected.get(k)]
    if not differing:
        return
    made = " / ".join(f"{k} {stored.get(k, '<not recorded>')}" for k in differing)
    uses = " / ".join(f"{k} {expected.get(k, '<not given>')}" for k in differing)
    raise CheckpointError(f"checkpoint {path} was made with {made}; this run uses {uses}")


# --- random number generators -----------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        # plain Python values, so that torch.load(weights_only=True) can read them back
        "numpy": [name, key.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
