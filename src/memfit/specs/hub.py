"""A model memfit does not bundle, named by its Hugging Face hub id: its config.json, fetched once with
huggingface_hub (and cached where huggingface_hub caches, so the next run works offline).

Offline — `HF_HUB_OFFLINE=1`, or the hub's host does not resolve — the answer is one line at once (huggingface_hub
itself would retry for about 25 s): a config.json cached by an earlier run is used, else the message says to give
the config.json's path. `HF_ENDPOINT` points at another hub (a mirror, or a test's local stand-in).
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
from urllib.parse import urlparse

from memfit.core.errors import MemfitError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")   # owner/name
DEFAULT_ENDPOINT = "https://huggingface.co"


def looks_like_hub_id(spec: str) -> bool:
    """owner/name that is not a file or folder here (nor a config.json path that does not exist)."""
    return bool(HUB_ID.match(spec)) and not spec.endswith(".json") and not os.path.exists(spec)


def hub_config(repo_id: str) -> dict:
    """The config.json of `repo_id` on the hub, or a one-line MemfitError."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise MemfitError(f"{repo_id!r} looks like a Hugging Face hub id; fetching its config.json needs "
                          "huggingface_hub (pip install huggingface_hub), or give the config.json's path.") from None
    endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    offline = _offline(endpoint)
    if not offline:
        print(f"memfit: fetching the config.json of {repo_id} from {endpoint}", file=sys.stderr)
    try:
        path = hf_hub_download(repo_id, "config.json", endpoint=endpoint, local_files_only=offline,
                               cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except Exception as exc:  # offline with nothing cached, a missing or gated repository, a network failure
        why = ("offline (HF_HUB_OFFLINE is set or the hub's host does not resolve) and not cached by an earlier run"
               if offline else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        raise MemfitError(f"cannot fetch the config.json of {repo_id} from the Hugging Face hub: {why}. Download it "
                          "(the model page's Files tab) and give its path, or name a bundled model "
                          "(`memfit models` lists them with their hub ids).") from None
    with open(path) as fh:
        return json.load(fh)


def _offline(endpoint: str) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no"):
        return True
    host = urlparse(endpoint).hostname
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return True
    return False
