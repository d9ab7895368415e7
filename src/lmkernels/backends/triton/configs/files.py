"""Launch tables measured on one GPU (`lmkernels tune --install`), as a JSON file that the
package loads on that GPU: tuning results are data, never edits of the code.

Where: LMKERNELS_CONFIG_DIR, else $XDG_CACHE_HOME/lmkernels/configs, else
~/.cache/lmkernels/configs; one file per GPU model, Triton version and schema:

    <gpu-name-slug>-<arch>-triton<version>-v<schema>.json
    e.g. nvidia-geforce-rtx-4090-sm_89-triton3.9.0-v1.json

LMKERNELS_CONFIG_DIR set to an empty value loads no file (the built-in tables everywhere).

The file (schema 1):

    {"schema": 1,
     "device": {"name": "NVIDIA GeForce RTX 4090", "arch": "sm_89"},
     "triton": "3.9.0", "lmkernels": "0.4.0", "created": "2026-12-01T10:00:00", "command": "...",
     "tables": {"name": ..., "norms": {...}, "rope": {...}, "flce": {...}}}

"tables" is a whole `records.Tables`, each record an object of its fields named as in
records.py (tuples as lists). Loading rebuilds the records and runs their checks: an unknown or
missing field, a value of the wrong type or a record's rule broken refuses the file. A file made
for another schema, another Triton version or another GPU is ignored with a warning (logger
"lmkernels") naming the reason and the command that makes a new one; the built-in tables run
instead (configs.tables_for).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

from lmkernels.backends.triton.configs import records
from lmkernels.registry.core import LMKernelsError

SCHEMA = 1
ENV = "LMKERNELS_CONFIG_DIR"
TUNE_COMMAND = "lmkernels tune --out DIR --install"

logger = logging.getLogger("lmkernels")


class ConfigFileError(LMKernelsError):
    """A tuned-tables file that cannot be used (its reason in the message)."""


@dataclasses.dataclass(frozen=True)
class DeviceIdentity:
    """What a tuned file is valid for: the GPU model (its name), its arch and the Triton version
    the kernels were compiled with."""

    name: str  # torch.cuda.get_device_name(), e.g. "NVIDIA A100-SXM4-80GB"
    arch: str  # "sm_80", "gfx942"
    triton: str  # triton.__version__

    @property
    def filename(self) -> str:
        return f"{self.prefix}triton{self.triton}-v{SCHEMA}.json"

    @property
    def prefix(self) -> str:
        """The start of the name of every file made for this GPU, whatever its versions."""
        return f"{slug(self.name)}-{self.arch}-"


def slug(name: str) -> str:
    """ "nvidia-a100-sxm4-80gb" for "NVIDIA A100-SXM4-80GB"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def identity_of(index: int) -> DeviceIdentity:
    """The identity of CUDA (ROCm) device `index`."""
    import torch
    import triton

    from lmkernels.backends.triton.configs.targets import device_target

    return DeviceIdentity(torch.cuda.get_device_name(index), device_target(index).name, triton.__version__)


def config_dir() -> Path | None:
    """The folder of tuned files (None: LMKERNELS_CONFIG_DIR is set empty, no file is loaded)."""
    value = os.environ.get(ENV)
    if value is not None:
        return Path(value).expanduser() if value.strip() else None
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "lmkernels" / "configs"


def config_path(identity: DeviceIdentity, directory: Path | None = None) -> Path | None:
    """Where the tuned file of `identity` lives (None where loading is off)."""
    folder = directory if directory is not None else config_dir()
    return None if folder is None else Path(folder) / identity.filename


# --- records <-> JSON ------------------------------------------------------------------------------


def tables_to_json(tables: records.Tables) -> dict[str, Any]:
    """`tables` as plain JSON values (records as objects of their fields, tuples as lists)."""
    return _plain(tables)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def tables_from_json(obj: Any) -> records.Tables:
    """The Tables an object of tables_to_json's form describes; ConfigFileError naming the
    field for an unknown or missing field, a value of the wrong type or a record's broken rule."""
    return _record(records.Tables, obj, "tables")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(records))


def _record(cls: type, obj: Any, where: str) -> Any:
    if not isinstance(obj, dict):
        raise ConfigFileError(f"{where}: a {cls.__name__} object expected, got {type(obj).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise ConfigFileError(f"{where}: {cls.__name__} has no field {', '.join(unknown)}")
    missing = [
        n
        for n, f in fields.items()
        if n not in obj and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigFileError(f"{where}: {cls.__name__} needs {', '.join(missing)}")
    hints = _hints(cls)
    values = {n: _value(hints[n], v, f"{where}.{n}") for n, v in obj.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigFileError(f"{where}: {e}") from None


def _value(tp: Any, v: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if v is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _value(option, v, where)
            except ConfigFileError as e:
                errors.append(str(e))
        raise ConfigFileError(errors[0] if len(errors) == 1 else f"{where}: {v!r} is none of {tp}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(v, list):
            raise ConfigFileError(f"{where}: a list expected, got {type(v).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], x, f"{where}[{i}]") for i, x in enumerate(v))
        if len(v) != len(args):
            raise ConfigFileError(f"{where}: {len(args)} values expected, got {len(v)}")
        return tuple(_value(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a record
        return _record(tp, v, where)
    if tp is bool:
        ok = type(v) is bool
    elif tp is int:
        ok = type(v) is int
    elif tp is float:
        ok = type(v) in (int, float)
    elif tp is str:
        ok = type(v) is str
    else:
        raise ConfigFileError(f"{where}: a field of type {tp} cannot be read from a file")
    if not ok:
        raise ConfigFileError(f"{where}: {getattr(tp, '__name__', tp)} expected, got {v!r}")
    return v


# --- the files ------------------------------------------------------------------------------------


def file_content(tables: records.Tables, identity: DeviceIdentity, command: str = "") -> dict[str, Any]:
    from lmkernels import __version__

    return {
        "schema": SCHEMA,
        "device": {"name": identity.name, "arch": identity.arch},
        "triton": identity.triton,
        "lmkernels": __version__,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "tables": tables_to_json(tables),
    }


def write_tuned(
    tables: records.Tables, identity: DeviceIdentity, directory: Path | None = None, command: str = ""
) -> Path:
    """Write `tables` as the tuned file of `identity` (in `directory`, default config_dir());
    returns its path. The content is read back first: a file that would not load is not written."""
    path = config_path(identity, directory)
    if path is None:
        raise ConfigFileError(f"{ENV} is set empty: no folder for tuned files (set it to one)")
    content = file_content(tables, identity, command)
    check_content(content, identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(content, indent=1) + "\n")
    tmp.replace(path)
    return path


def check_content(content: Any, identity: DeviceIdentity | None = None) -> records.Tables:
    """The tables of a file's content, or ConfigFileError saying why they cannot be used for
    `identity` (None: any GPU): stale (schema, Triton), another GPU, or a malformed table."""
    if not isinstance(content, dict):
        raise ConfigFileError("not a JSON object")
    known = {"schema", "device", "triton", "lmkernels", "created", "command", "tables"}
    unknown = sorted(set(content) - known)
    if unknown:
        raise ConfigFileError(f"unknown field {', '.join(unknown)}")
    if content.get("schema") != SCHEMA:
        raise ConfigFileError(
            f"stale: schema {content.get('schema')!r} of an earlier lmkernels, this one reads schema {SCHEMA}"
        )
    device = content.get("device")
    if not isinstance(device, dict) or set(device) != {"name", "arch"}:
        raise ConfigFileError("device: an object of name and arch expected")
    if identity is not None:
        if content.get("triton") != identity.triton:
            raise ConfigFileError(
                f"stale: tuned with triton {content.get('triton')}, this is triton {identity.triton}"
            )
        if (device["name"], device["arch"]) != (identity.name, identity.arch):
            raise ConfigFileError(
                f"from another GPU: {device['name']} ({device['arch']}), this is {identity.name} ({identity.arch})"
            )
    return tables_from_json(content.get("tables"))


def read_tuned(path: Path, identity: DeviceIdentity | None = None) -> records.Tables:
    """The tables of the file at `path` (ConfigFileError: why they cannot be used)."""
    try:
        content = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigFileError(f"{path}: cannot be read ({e})") from None
    try:
        return check_content(content, identity)
    except ConfigFileError as e:
        raise ConfigFileError(f"{path}: {e}") from None


def load_tuned(identity: DeviceIdentity, directory: Path | None = None) -> records.Tables | None:
    """The tuned tables of `identity`, or None: no file (a warning where files of this GPU for
    other versions are there), or a file that cannot be used (a warning saying why)."""
    path = config_path(identity, directory)
    if path is None:
        return None
    if not path.exists():
        others = (
            sorted(p.name for p in path.parent.glob(identity.prefix + "triton*.json"))
            if path.parent.is_dir()
            else []
        )
        if others:
            _warn_once(
                f"lmkernels: tuned launch tables for {identity.name} in {path.parent} are stale ({', '.join(others)}: "
                f"another Triton version or lmkernels schema; this is triton {identity.triton}, schema {SCHEMA}): "
                f"ignored, the built-in tables run. Run `{TUNE_COMMAND}` again."
            )
        return None
    try:
        tables = read_tuned(path, identity)
    except ConfigFileError as e:
        _warn_once(
            f"lmkernels: tuned launch tables ignored, the built-in tables run: {e}. Run `{TUNE_COMMAND}`."
        )
        return None
    logger.info("lmkernels: launch tables for %s from %s", identity.name, path)
    return tables


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
