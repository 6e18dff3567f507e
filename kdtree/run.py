"""kdtree's entry point: compose the config (Hydra) -> validate it -> run the pipeline.

    python -m kdtree.run                                        # default pipeline (serve) on the embedded tiny model
    python -m kdtree.run pipeline=generate prompt='2+2=' max_new_tokens=16
    python -m kdtree.run --cfg job model=k26 tp=8 backend=cuda  # show the composed config
    python -m kdtree.run -m pipeline=bench tree.width=1,2,4     # sweep (Hydra multirun)
    python -m kdtree.run -v ...                                 # also third-party log lines (paramiko)

Data flow in three hops: conf/ + kdtree/config (what to run) -> kdtree/pipeline (in which order, where)
-> kdtree/stages/<name>.py (the work).
"""
from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from kdtree.backends import check_device
from kdtree.config.schema import CONF_DIR, GROUPS
from kdtree.config.secrets import redact, secrets
from kdtree.config.validate import check_group_overrides, loads_model, validate
from kdtree.errors import KdtreeError
from kdtree.pipeline.registry import register_schema
from kdtree.pipeline.runner import run_pipeline



def _fail(message: str, code: int = 2) -> None:
    print(f"kdtree: error: {message}", file=sys.stderr)
    sys.exit(code)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    _redact_hydra_files(run_dir, cfg)
    # Ctrl-C, a supervisor's stop, a closed terminal: each stops the run the same way. SIGINT too, explicitly: a
    # process started with SIGINT ignored (a script's background job, a test runner launched so) would otherwise
    # inherit the ignore -- Python installs its Ctrl-C handler only where SIGINT is not ignored -- and never stop
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        validate(cfg)
        if loads_model(cfg):
            check_device(cfg)
        code = run_pipeline(cfg, run_dir)
    except KdtreeError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    if code:
        sys.exit(code)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _redact_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """Hydra saved the overrides and the config under .hydra/ before kdtree ran: no secret stays in them."""
    values = secrets(cfg)
    for f in (run_dir / ".hydra").glob("*.yaml") if values else ():
        text = f.read_text()
        if any(v in text for v in values):
            f.write_text(redact(text, values))


FREE_TEXT_KEYS = {"prompt"}  # values taken verbatim: `prompt='2+2='` must not need Hydra's quoting rules


def _hydra_quote(value: str) -> str:
    """Single-quote for Hydra's grammar: backslashes are escapes only before a quote or the closing quote."""
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return f"'{body}'"


def quote_for_hydra(argv):
    """Make the commands of the design work as typed in a shell.

    `tp=8` -> `tp='8'` (Hydra parses 8 as an int, but config group choices are names), and free-text
    values (`prompt=2+2=` after the shell removed its quotes) are quoted so Hydra takes them verbatim.
    """
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+~")
        if sep and bare in GROUPS and value and all(v.isdigit() for v in value.split(",")):
            value = ",".join(f"'{v}'" for v in value.split(","))
        elif sep and bare in FREE_TEXT_KEYS and not (len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""):
            value = _hydra_quote(value)
        out.append(f"{key}{sep}{value}" if sep else arg)
    return out


VERBOSE_FLAGS = ("-v", "--verbose")


def main() -> None:
    if any(a in VERBOSE_FLAGS for a in sys.argv[1:]):   # ours, not Hydra's: library loggers speak (KDTREE_VERBOSE)
        os.environ["KDTREE_VERBOSE"] = "1"
        sys.argv[1:] = [a for a in sys.argv[1:] if a not in VERBOSE_FLAGS]
    register_schema()
    try:
        check_group_overrides(sys.argv[1:], CONF_DIR, GROUPS)
    except KdtreeError as e:
        _fail(str(e))
    sys.argv[1:] = quote_for_hydra(sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()
