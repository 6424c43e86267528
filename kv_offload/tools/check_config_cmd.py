"""`kv-offload check-config CONFIG`: every check the connector makes at start-up, without vLLM.

A typo in `--kv-transfer-config` used to surface after vLLM had loaded the weights, among
hundreds of log lines. This runs the same checks in seconds, before anything is started:

1. the JSON itself: the whole `--kv-transfer-config` (its `kv_connector`, `kv_role`,
   `kv_load_failure_policy` and `kv_connector_extra_config`) or only the extra config;
   inline, from a file, or `-` for standard input;
2. `check_before_engine_start`, exactly as the connector runs it before the model loads:
   keys, types and values (a typo names the nearest key), the eviction policy, the storage
   tier's options, `secret_file` (present, private, long enough), the disk directory
   (writable) and host memory for one rank;
3. the storage tier itself: opened as an engine opens it and asked for its generation
   record (bounded by the tier's own timeouts): reachable, credentials accepted. Skipped for
   the disk tier (step 2 already wrote a probe file in its root; opening it would create a
   layout directory for a layout no engine has) and with `--offline`.

Then it prints what an engine would set up (host memory per rank, the storage tier and
where, the record mode, how the weights are identified). Exit status 0 when everything
checked out; 1 with the engine's own error as the last line of the output otherwise; 2 for
bad arguments (an unreadable file, JSON that does not parse).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kv_offload.config import OffloadConfig, format_size
from kv_offload.errors import ConfigError

ROLES = ("kv_both", "kv_producer", "kv_consumer")
DESCRIPTION = __doc__.split("\n\n", 1)[1].rsplit("\n\nThen", 1)[0]


def add_check_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG",
                        help="the JSON given to --kv-transfer-config (or only its "
                             "kv_connector_extra_config): inline, a file's path, or - for "
                             "standard input")
    parser.add_argument("--offline", action="store_true",
                        help="do not contact the storage tier (check the configuration only)")


def load_config(text_or_path: str) -> dict[str, Any]:
    """The JSON object CONFIG names; raises ValueError naming what is wrong."""
    if text_or_path == "-":
        text = sys.stdin.read()
    elif text_or_path.lstrip().startswith("{"):
        text = text_or_path
    else:
        try:
            text = Path(text_or_path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read {text_or_path}: {exc.strerror or exc}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"CONFIG is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"CONFIG must be a JSON object, got {type(value).__name__}")
    return value


def check_transfer_config(transfer: dict[str, Any]) -> list[str]:
    """The top-level keys vLLM reads for us; raises ConfigError as vLLM or the connector
    would; returns notes for what works but is not what the docs recommend."""
    notes = []
    connector = transfer.get("kv_connector")
    if connector is not None and connector != "KVOffloadConnector":
        raise ConfigError(f"kv_connector is {connector!r}; kv-offload's connector is "
                          f"'KVOffloadConnector' (with kv_connector_module_path "
                          f"'kv_offload.vllm')")
    module = transfer.get("kv_connector_module_path")
    if connector is not None and module != "kv_offload.vllm":
        raise ConfigError(f"kv_connector_module_path is {module!r}; set it to "
                          f"'kv_offload.vllm' (vLLM imports the connector from there)")
    role = transfer.get("kv_role")
    if role is not None and role not in ROLES:
        raise ConfigError(f"kv_role must be one of {list(ROLES)}, got {role!r}")
    if transfer.get("kv_load_failure_policy", "fail") != "recompute":
        notes.append("kv_load_failure_policy is not 'recompute': the connector switches it "
                     "to 'recompute' (a failed load is recomputed, not a failed request)")
    return notes


def describe(config: OffloadConfig, tier_line: str | None) -> list[tuple[str, str]]:
    """What an engine would set up, as rows."""
    mode = ("encrypted (AES-256-GCM) and authenticated" if config.encrypt else
            "authenticated (HMAC-SHA256)" if config.secret_file else "checksummed only")
    from kv_offload.backends import storage_choice

    choice = storage_choice(config)
    rows = [("host tier", f"{format_size(config.cpu_bytes_to_use)} per worker rank"),
            ("storage tier", tier_line or (choice.name if choice else "none (host memory "
                                                                         "only)")),
            ("records", mode if choice else "-"),
            ("weights", f"named by model_identity {config.model_identity!r}"
             if config.model_identity else "every byte of the weight files (remembered)")]
    return rows


def probe_tier(config: OffloadConfig) -> str | None:
    """Open the storage tier as an engine does and ask it for its generation record (bounded
    by its timeouts); its description, or None when there is none or it is not probed.
    Raises ConfigError when it cannot be reached or refuses the credentials."""
    from kv_offload.backends import make_storage_tier, storage_choice

    choice = storage_choice(config)
    if choice is None or choice.name == "filesystem":
        return None
    tier = make_storage_tier(config, "kv-offload check-config")
    try:
        line = tier.describe()
        try:
            tier.read_generation()
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"storage_tier {choice.name!r} ({line}) cannot be reached: "
                              f"{type(exc).__name__}: {exc}; an engine would start with host "
                              f"memory only until it answers") from exc
        return f"{line}: reachable"
    finally:
        tier.close()


def run_check_config(args: argparse.Namespace) -> int:
    from kv_offload.store.startup_checks import check_before_engine_start

    try:
        value = load_config(args.config)
    except ValueError as exc:
        print(f"kv-offload check-config: {exc}", file=sys.stderr)
        return 2
    transfer = value if "kv_connector_extra_config" in value or "kv_connector" in value \
        else {"kv_connector_extra_config": value}
    try:
        notes = check_transfer_config(transfer)
        config = check_before_engine_start(transfer.get("kv_connector_extra_config"))
        tier_line = None if args.offline else probe_tier(config)
    except ConfigError as exc:
        print(f"ConfigError: {exc}")
        return 1
    for name, text in describe(config, tier_line):
        print(f"{name:13} {text}")
    for note in notes:
        print(f"note          {note}")
    print("ok: every start-up check passed")
    return 0
