"""Hugging Face Hub model ids (`--model Qwen/Qwen3-0.6B`): resolved to a snapshot directory in the Hub
cache with `huggingface_hub`. With `HF_HUB_OFFLINE=1` only the cache is read; otherwise the files a
node needs (config, tokenizer, chat template, safetensors weights) are downloaded once into the cache.
`--revision` picks a branch, tag or commit (default: main)."""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

# owner/name as the Hub spells repository ids: letters, digits, '-', '_', '.'; no '..' and no leading
# or trailing '.' or '-' in either part
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")
# what a node reads of a model repository: never the .bin/.pt/.gguf/onnx copies many repos also carry
NEEDED_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]


class HubError(ValueError):
    """The model id cannot be resolved; the message says why and what to do."""


def is_hub_id(model: str) -> bool:
    """`model` names a Hub repository, not a local path (a path that exists always wins)."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model and not os.path.exists(model)


def resolve_hub_model(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot directory of `repo_id` at `revision`, downloaded unless offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = constants.HF_HUB_OFFLINE
    where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    if not offline:
        logger.info("fetching %s from the Hugging Face Hub into %s (files already cached are kept)",
                    where, constants.HF_HUB_CACHE)
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=NEEDED_FILES,
                                 local_files_only=offline)
    except LocalEntryNotFoundError:
        if offline:
            raise HubError(f"--model: {where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                           "and HF_HUB_OFFLINE=1 forbids downloading it") from None
        raise HubError(f"--model: {where} could not be downloaded (no connection to the Hub?) and is not "
                       f"in the cache ({constants.HF_HUB_CACHE})") from None
    except RevisionNotFoundError:
        raise HubError(f"--revision: {revision!r} is not a branch, tag or commit of {repo_id}") from None
    except GatedRepoError:
        raise HubError(f"--model: {repo_id} is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise HubError(f"--model: no such model repository on the Hub: {repo_id} (or it is private: set "
                       "HF_TOKEN)") from None
    except OSError as e:
        raise HubError(f"--model: {where} could not be fetched: {e}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise HubError(f"--model: {where} has no config.json: not a transformers model repository")
    return path
