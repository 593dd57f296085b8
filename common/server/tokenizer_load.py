"""Load a model's tokenizer for the front end: transformers' the first time, the light one after that
when it answers the same.

Importing transformers and loading its tokenizer costs ~2.3 s of a core at every node start here (the
package's import alone ~1.4 s); `LightTokenizer` reads the same files with the `tokenizers` library and
jinja2 in ~0.4 s. It is used only for a tokenizer it was checked against: the first start with a
tokenizer loads transformers' (`AutoTokenizer`), compares the two (`light_mismatch`: the same backend,
vocabulary, special tokens and chat template; the same ids and text for a set of texts, ids and
conversations, errors included) and remembers the verdict and the class `AutoTokenizer` picked in
`${PDSERVE_CACHE:-~/.cache/pdserve}/tokenizer-classes/`, keyed by the content of the tokenizer files, the
`--chat-template` file, and the versions of transformers, tokenizers and jinja2. Later starts use the
light tokenizer when it matched, else transformers' class directly (without `AutoTokenizer`, which reads
the model's config and imports torch). A directory with remote code (`auto_map`) always goes through
`AutoTokenizer`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import metadata

from common.server.detokenizer import special_token_ids
from common.server.light_tokenizer import LightTokenizer

logger = logging.getLogger(__name__)

_KEY_FILES = ("tokenizer_config.json", "config.json", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json")
CHECK_VERSION = "1"  # bump when LightTokenizer or light_mismatch changes what they compare

PROBE_TEXTS = (
    "Hello, world! What is the capital of France?",
    "  leading and trailing spaces  \n\n\ttabs\r\nand line ends ",
    "naïve café, Straße, 東京, Ελληνικά, русский, emoji 🙂👍🏽, math ∑∫√",
    "def f(x):\n    return [i ** 2 for i in range(x)]  # code\n",
    "numbers 1234567890 3.14159 -42 1e-9, URLs https://example.com/a?b=c&d=e",
    "<|im_start|>user\nspecial <|endoftext|> tokens <s> </s> [INST] inline<|im_end|>",
    "",
)
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PROBE_CHATS = (  # (messages, tools, add_generation_prompt, continue_final_message, variables)
    ([{"role": "user", "content": "Hi there"}], None, True, False, {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One?"},
      {"role": "assistant", "content": "Two."}, {"role": "user", "content": "Three?"}],
     None, False, False, {}),
    ([{"role": "user", "content": "Start a list"}, {"role": "assistant", "content": "1. eggs\n2. "}],
     None, False, True, {}),
    ([{"role": "user", "content": "Weather in Paris?"}], PROBE_TOOLS, True, False,
     {"enable_thinking": False}),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [
          {"id": "c1", "type": "function",
           "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], PROBE_TOOLS, True, False, {}),
    ([{"role": "user", "content": [{"type": "text", "text": "parts"}, {"type": "text", "text": " of text"}]}],
     None, True, False, {}),
    ([{"role": "assistant", "content": "no user"}], None, False, False, {"custom_flag": True}),
)


def cache_path(path: str, chat_template: str | None) -> str | None:
    """The cache file for the tokenizer at `path` (a directory) with the `--chat-template` text
    `chat_template`, or None when it cannot be cached."""
    if not os.path.isdir(path):
        return None
    h = hashlib.sha256(CHECK_VERSION.encode())
    for package in ("transformers", "tokenizers", "jinja2"):
        try:
            h.update(f"{package}={metadata.version(package)};".encode())
        except metadata.PackageNotFoundError:
            pass
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
    if chat_template is not None:
        h.update(b"--chat-template" + hashlib.sha256(chat_template.encode()).digest())
    from common.models.default_model import cache_root

    return os.path.join(cache_root(), "tokenizer-classes", h.hexdigest()[:32] + ".json")


def _outcome(fn, *args, **kwargs):
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception:  # noqa: BLE001 - both must refuse the same inputs; their messages may differ
        return ("error", None)


def light_mismatch(hf, light) -> str | None:
    """What `light` answers differently from transformers' tokenizer `hf`, or None when nothing does."""
    if hf.backend_tokenizer.to_str() != light.backend_tokenizer.to_str():
        return "the backend tokenizer differs from tokenizer.json"
    if len(hf) != len(light) or hf.get_vocab() != light.get_vocab():
        return "the vocabulary"
    if special_token_ids(hf) != special_token_ids(light) \
            or set(hf.all_special_ids) != set(light.all_special_ids):
        return "the special token ids"
    if hf.special_tokens_map != light.special_tokens_map:
        return "the special tokens' names"
    if hf.chat_template != light.chat_template:
        return "the chat template"
    for text in PROBE_TEXTS:
        for specials in (True, False):
            ids = hf.encode(text, add_special_tokens=specials)
            if list(ids) != light.encode(text, add_special_tokens=specials):
                return f"encode({text!r}, add_special_tokens={specials})"
            for skip in (True, False):
                if hf.decode(ids, skip_special_tokens=skip) != light.decode(ids, skip_special_tokens=skip):
                    return f"decode of {text!r} (skip_special_tokens={skip})"
    n = len(hf)
    singles = sorted(set(range(min(n, 300))) | set(range(0, n, max(1, n // 300))) | special_token_ids(hf))
    for i in singles:
        if hf.decode([i]) != light.decode([i]):
            return f"decode([{i}])"
    if hf.chat_template:
        for messages, tools, gen, cont, variables in PROBE_CHATS:
            want = _outcome(hf.apply_chat_template, messages, tools=tools, add_generation_prompt=gen,
                            continue_final_message=cont, tokenize=False, **variables)
            got = _outcome(light.apply_chat_template, messages, tools=tools, add_generation_prompt=gen,
                           continue_final_message=cont, tokenize=False, **variables)
            if want != got:
                return f"the chat template's rendering of {messages!r}"
    return None


def read_entry(cache: str | None) -> dict:
    if cache is None or not os.path.isfile(cache):
        return {}
    try:
        with open(cache) as f:
            entry = json.load(f)
        return entry if isinstance(entry, dict) else {}
    except (OSError, ValueError) as e:
        logger.info("tokenizer cache %s unusable (%s)", cache, e)
        return {}


def write_entry(cache: str, entry: dict) -> None:
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, cache)
    except OSError as e:
        logger.info("cannot remember the tokenizer in %s: %s", cache, e)


def _transformers_tokenizer(path: str, name: str | None):
    if name:
        try:
            import transformers

            return getattr(transformers, name).from_pretrained(path)  # the lazy module: no torch
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.info("tokenizer class %s unusable (%s); asking AutoTokenizer", name, e)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(path: str, chat_template: str | None = None):
    """The tokenizer at `path` (a directory or a hub id), with `chat_template` (the text of a
    `--chat-template` file) in place of the model's own when given."""
    cache = cache_path(path, chat_template)
    entry = read_entry(cache)
    if entry.get("light"):
        light = LightTokenizer.open(path, chat_template)
        if light is not None:
            logger.info("tokenizer at %s: read without transformers (checked at an earlier start)", path)
            return light
    hf = _transformers_tokenizer(path, entry.get("class"))
    if "light" in entry:
        logger.info("tokenizer at %s: transformers' %s (%s)", path, type(hf).__name__,
                    "the light one differed at its check" if not entry["light"]
                    else "the light one cannot read it")
    if chat_template is not None:
        hf.chat_template = chat_template
    if cache is not None and ("light" not in entry or entry.get("class") != type(hf).__name__):
        light = LightTokenizer.open(path, chat_template)
        try:
            why = "no tokenizer.json it can read alike" if light is None else light_mismatch(hf, light)
        except Exception as e:  # noqa: BLE001 - a check that cannot finish keeps transformers' tokenizer
            why = f"the check itself ({type(e).__name__}: {e})"
        if why:
            logger.info("tokenizer at %s: transformers' %s at every start (the light one differs in %s)",
                        path, type(hf).__name__, why)
        else:
            logger.info("tokenizer at %s: checked against transformers' %s; later starts read it without "
                        "transformers", path, type(hf).__name__)
        write_entry(cache, {"class": type(hf).__name__, "path": os.path.realpath(path), "light": not why})
    return hf
