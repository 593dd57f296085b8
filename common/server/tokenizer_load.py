"""Load a model's tokenizer as transformers' `AutoTokenizer` would, without paying for its choice twice.

`AutoTokenizer.from_pretrained` always reads the model's config through `AutoConfig` to pick the
tokenizer class, which imports the model's configuration module and with it torch: about 4 s of a
node's start-up on this machine, spent in the front end, which needs no torch. The class it picks
depends only on the model directory's tokenizer files (`tokenizer_config.json`, `config.json`, whether and
which `tokenizer.json` there is) and on the transformers version, so `load_tokenizer` remembers it per
the content of those files in `${PDSERVE_CACHE:-~/.cache/pdserve}/tokenizer-classes/`; the next start loads that class
directly (`transformers.<name>.from_pretrained(path)`, the call `AutoTokenizer` ends with), and gets
the same tokenizer in about 1.5 s, without torch. A directory with remote code (`auto_map`) always goes through
`AutoTokenizer`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

logger = logging.getLogger(__name__)

_KEY_FILES = ("tokenizer_config.json", "config.json", "special_tokens_map.json")


def _cache_path(path: str) -> str | None:
    """The cache file for the tokenizer at `path` (a directory), or None when it cannot be cached."""
    if not os.path.isdir(path):
        return None
    import transformers

    h = hashlib.sha256(transformers.__version__.encode())
    for name in _KEY_FILES:
        f = os.path.join(path, name)
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                data = fh.read()
            if name == "tokenizer_config.json" and b"auto_map" in data:
                return None  # remote code: its own rules
            h.update(name.encode() + hashlib.sha256(data).digest())
    for name in ("tokenizer.json", "tokenizer.model"):  # by content (~10 ms for a few MB): a copy of the
        f = os.path.join(path, name)                     # same files, a new mtime, finds the same entry
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                h.update(name.encode() + hashlib.file_digest(fh, "sha256").digest())
    from common.models.default_model import cache_root

    return os.path.join(cache_root(), "tokenizer-classes", h.hexdigest()[:32] + ".json")


def load_tokenizer(path: str):
    cache = _cache_path(path)
    if cache is not None and os.path.isfile(cache):
        try:
            with open(cache) as f:
                name = json.load(f)["class"]
            import transformers

            return getattr(transformers, name).from_pretrained(path)  # the lazy module: no torch
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.info("tokenizer class cache %s unusable (%s); asking AutoTokenizer", cache, e)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if cache is not None:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = f"{cache}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"class": type(tok).__name__, "path": os.path.realpath(path)}, f)
            os.replace(tmp, cache)
        except OSError as e:
            logger.info("cannot remember the tokenizer class in %s: %s", cache, e)
    return tok
