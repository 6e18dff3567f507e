"""The /v1 API key: where it comes from, and keeping it out of the run dir and off command lines.

    key = api_key(cfg.serve)           # KDTREE_API_KEY, else the contents of serve.api_key_file, else ""
    key = api_key(cfg.health, "health")  # the monitor's: KDTREE_API_KEY, else health.api_key_file
    text = redact(text, secrets(cfg))  # every secret value replaced by REDACTED (saved configs, .hydra/*.yaml)

The key never travels as a command-line argument: the engine inherits KDTREE_API_KEY from the controller's
environment (local), reads it from stdin at launch (ssh: Host.start_detached secret_env), or reads
serve.api_key_file on its host; the monitor's curl reads the Authorization header from stdin (-H @-). serve.api_key= and
health.api_key= on a command line are refused (kdtree/config/validate.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, List

from kdtree.errors import ConfigError

ENV = "KDTREE_API_KEY"
REDACTED = "<redacted>"


def api_key(section_cfg, section: str = "serve") -> str:
    """The key ("" = no key): KDTREE_API_KEY, else `<section>.api_key_file`'s first line. section "serve": the key
    the server checks; "health": the one the monitor sends."""
    key = os.environ.get(ENV, "")
    if key:
        return key.strip()
    path = str(section_cfg.get("api_key_file", "") or "")
    if not path:
        return ""
    p = Path(path).expanduser()
    try:
        key = p.read_text().strip()
    except OSError as e:
        raise ConfigError(f"{section}.api_key_file={path}: cannot read it ({e.strerror}); give a readable file "
                          f"holding the key, or export {ENV}") from None
    if not key:
        raise ConfigError(f"{section}.api_key_file={path} is empty; write the key into it, or leave "
                          f"{section}.api_key_file empty for no key")
    return key


def secrets(cfg) -> List[str]:
    """Every secret value the composed config carries or points at (for redaction)."""
    found = [os.environ.get(ENV, "")]
    for section in ("serve", "health"):
        sec = cfg.get(section) if hasattr(cfg, "get") else None
        if sec is not None:
            found.append(str(sec.get("api_key", "") or ""))
    for section in ("serve", "health"):
        try:
            found.append(api_key(cfg[section], section))
        except (ConfigError, AttributeError, KeyError):
            pass
    return sorted({s for s in found if s}, key=len, reverse=True)


def redact(text: str, values: Iterable[str]) -> str:
    for v in values:
        text = text.replace(v, REDACTED)
    return text
