"""Convert a GGUF file into a Hugging Face directory once, and cache it.

With `weights=False` (quantization "gguf": the engine reads the blocks from the GGUF itself) the
directory holds the config and the tokenizer only, under `<stem>-<fingerprint>-config/`.

transformers reads GGUF (`gguf_file=`) by dequantizing every tensor, which takes ~20 s for the
default model on two cores; doing that at every start would dominate start-up. We do it once and
save config.json + model.safetensors (float32, the exact dequantized values) + the tokenizer with
its chat template under `<cache root>/<file stem>-<fingerprint>/`.

The cache is written into a temporary directory beside it and renamed into place, so a cache
directory with a config.json is always complete: an interrupted or failed conversion leaves nothing
that is ever read back, and two processes converting at once both end up with one good copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile

GGUF_MAGIC = b"GGUF"
_FINGERPRINT_BYTES = 1 << 20


def gguf_cache_dir(gguf_path: str, cache_root: str) -> str:
    """Where the conversion of `gguf_path` lives: keyed by file size and its first MiB."""
    digest = hashlib.sha256(str(os.path.getsize(gguf_path)).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_FINGERPRINT_BYTES))
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root, f"{stem}-{digest.hexdigest()[:12]}")


def is_complete(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, "config.json"))


def convert_gguf(gguf_path: str, cache_root: str, weights: bool = True) -> str:
    """Return a Hugging Face directory with the contents of `gguf_path` (without the weights
    unless `weights`), converting on first use.

    Raises ValueError("could not read GGUF file ...") when the file is not a readable GGUF.
    """
    gguf_path = os.path.abspath(gguf_path)
    check_gguf_magic(gguf_path)
    out_dir = gguf_cache_dir(gguf_path, cache_root) + ("" if weights else "-config")
    if is_complete(out_dir):
        return out_dir
    os.makedirs(cache_root, exist_ok=True)
    # One conversion at a time per cache (a lock on its directory, so no lock file is left):
    # the models of a repository start together and would each convert.
    lock = os.open(cache_root, os.O_RDONLY)
    try:
        if not _try_lock(lock):
            print(
                f"Waiting for another process converting into {cache_root} ...",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_complete(out_dir):
            _convert_into(gguf_path, out_dir, cache_root, weights)
    finally:
        os.close(lock)  # releases the lock
    return out_dir


def check_gguf_magic(gguf_path: str) -> None:
    with open(gguf_path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"could not read GGUF file {gguf_path}: not a GGUF file "
            f"(starts with {magic!r}, expected {GGUF_MAGIC!r})"
        )


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _convert_into(gguf_path: str, out_dir: str, cache_root: str, weights: bool) -> None:
    print(
        f"Converting {gguf_path} to a Hugging Face directory at {out_dir} "
        f"({'' if weights else 'config and tokenizer only; '}once; later starts reuse it)",
        file=sys.stderr,
        flush=True,
    )
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=cache_root)
    os.chmod(tmp_dir, 0o755)
    try:
        try:
            (_convert if weights else _convert_config)(gguf_path, tmp_dir)
        except Exception as e:
            raise ValueError(
                f"could not read GGUF file {gguf_path}: {type(e).__name__}: {e}"
            ) from e
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            if not is_complete(out_dir):  # nobody else finished it either
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _convert(gguf_path: str, out_dir: str) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = os.path.split(gguf_path)
    steps = tqdm(total=4, desc="GGUF -> Hugging Face", unit="step", file=sys.stderr)
    with steps:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        steps.update()
        steps.set_postfix_str("dequantize weights")
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("write safetensors")
        tied = bool(model.config.tie_word_embeddings)
        state = {
            k: v.detach().contiguous()
            for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")
        }
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        steps.update()
        steps.set_postfix_str("write config and tokenizer")
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        tokenizer.save_pretrained(out_dir)
        model.generation_config.save_pretrained(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:  # last: marks completion
            json.dump(config, f, indent=2, sort_keys=True)
        steps.update()


def _convert_config(gguf_path: str, out_dir: str) -> None:
    """The config, generation config and tokenizer of `gguf_path`, no weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    src_dir, name = os.path.split(gguf_path)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=name).save_pretrained(out_dir)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    values = config.to_dict()
    values.pop("quantization_config", None)
    values["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    with open(os.path.join(out_dir, "config.json"), "w") as f:  # last: marks completion
        json.dump(values, f, indent=2, sort_keys=True)
