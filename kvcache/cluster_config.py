"""The cluster config of ``kvcache up`` / ``kvcache down``: its schema of known keys, where each
value comes from, and the errors a person can act on.

Precedence, highest first: command-line flags (``--set SECTION.KEY=VALUE`` and the dedicated
flags such as ``--state-dir``) > environment (``KVCACHE_KEY`` for ``[cluster]`` keys,
``KVCACHE_SECTION_KEY`` for the other sections) > the config file (``--config``) > defaults.
``[[node]]`` tables come from the file (or the defaults) only; their unset keys inherit from
``[defaults]``. A relative ``state_dir`` in a config file is relative to that file's directory;
from a flag, the environment or the defaults, to the current directory.

Adding a key is one line of the schema (``kvcache.cluster_schema``); its environment variable
and ``--set`` come with it. Code reads it from ``ClusterConfig.settings`` (or
``NodeSpec.settings``).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import KVStoreError

from .cluster_schema import DEFAULT_TABLES, NO_LAYOUT, SECTIONS, TABLES, Key

ENV_PREFIX = "KVCACHE_"


class ConfigError(ValueError):
    """A config a person must fix; the message says what and where."""


# ------------------------------------------------------------------------------------------------


def env_name(section: str, key: str) -> str:
    return (ENV_PREFIX + (key if section == "cluster" else f"{section}_{key}")).upper()


@dataclass
class NodeSpec:
    id: str
    role: str
    layout: str  # "": none (it serves what its clients register)
    dram: str
    ssd: str = "0"
    settings: dict[str, Any] = field(default_factory=dict)  # every key of its [[node]] table


@dataclass
class ClusterConfig:
    host: str
    state_dir: str
    token: str | None
    transport: str
    policy: str
    nodes: list[NodeSpec]
    conductor_args: list[str] = field(default_factory=list)
    tls: bool = False
    # The merged sections (every known key) and, per "section.key", where its value came from.
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    path: str | None = None  # the config file, if any

    def get(self, section: str, key: str) -> Any:
        return self.settings.get(section, {}).get(key, SECTIONS[section][key].default)


def _where(path: str | None) -> str:
    return path or "the embedded config"


def _known(what: str, name: str, known: list[str], scope: str = "") -> str:
    """ "unknown key 'polcy' in [conductor] (did you mean 'policy'? known: ...)"."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    scope = f" in {scope}" if scope else ""
    return f"unknown {what} {name!r}{scope} ({hint}known: {', '.join(known)})"


def _line_of(text: str, header: str, key: str, nth: int = 0) -> int | None:
    """The line of ``key = ...`` under the ``nth`` occurrence of ``header`` ("[cluster]",
    "[[node]]"), for error messages; None when not found (e.g. an inline table)."""
    current, seen = None, -1
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("["):
            current = s.split("#", 1)[0].strip()
            if current == header:
                seen += 1
            continue
        if current == header and seen == nth and re.match(rf'["\']?{re.escape(key)}["\']?\s*=', s):
            return n
    return None


def coerce(value: Any, key: Key, where: str) -> Any:
    """Check a file value's type (TOML already typed it); a clear error otherwise."""
    t = key.type
    if t is bool and not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if t is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if t is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if t is float:
        value = float(value)
    if t is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # sizes: dram = 0
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
    if t is list and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
        raise ConfigError(f"{where} must be a list of strings, got {value!r}")
    if key.choices and value not in key.choices:
        raise ConfigError(f"{where} must be one of {', '.join(key.choices)}; got {value!r}")
    if key.check is not None:
        try:
            key.check(value)
        except (ValueError, KVStoreError) as e:
            raise ConfigError(f"{where}: {e}") from None
    return value


def parse_text(text: str, key: Key, where: str) -> Any:
    """A value given as text (environment, --set, a flag) -> the key's type."""
    t = key.type
    value: Any = text
    if t is bool:
        low = text.strip().lower()
        if low not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ConfigError(f"{where} must be true or false, got {text!r}")
        value = low in ("1", "true", "yes", "on")
    elif t is int:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"{where} must be an integer, got {text!r}") from None
    elif t is float:
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{where} must be a number, got {text!r}") from None
    elif t is list:
        value = shlex.split(text)
    return coerce(value, key, where)


def read_file(path: str) -> tuple[dict[str, Any], str]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read cluster config {path}: {e.strerror}") from None
    text = raw.decode("utf-8", errors="replace")
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def parse_set(items: list[str]) -> dict[str, str]:
    """``--set SECTION.KEY=VALUE`` items -> {"section.key": "value"}."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        section, dot, key = name.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(
                f"--set expects SECTION.KEY=VALUE (e.g. cluster.tls=true), got {item!r}"
            )
        if section not in SECTIONS:
            raise ConfigError("--set: " + _known("section", section, list(SECTIONS)))
        if key not in SECTIONS[section]:
            raise ConfigError(
                "--set: " + _known("key", key, list(SECTIONS[section]), f"[{section}]")
            )
        out[f"{section}.{key}"] = value
    return out


def load_config(
    path: str | None = None,
    env: dict[str, str] | None = None,
    flags: dict[str, Any] | None = None,
    sets: list[str] = (),  # type: ignore[assignment]
) -> ClusterConfig:
    """Merge defaults < ``path`` < ``env`` (default: os.environ) < ``sets`` and ``flags``
    ({"section.key": value} of the dedicated flags, already typed; None: not given)."""
    env = os.environ if env is None else env
    settings = {s: {k: key.default for k, key in keys.items()} for s, keys in SECTIONS.items()}
    sources = {f"{s}.{k}": "default" for s, keys in SECTIONS.items() for k in keys}
    tables = {name: [dict(t) for t in rows] for name, rows in DEFAULT_TABLES.items()}
    text = ""
    where = _where(path)
    base_dir = os.getcwd()
    if path:
        data, text = read_file(path)
        base_dir = os.path.dirname(os.path.abspath(path))
        for section, value in data.items():
            if section in SECTIONS:
                if not isinstance(value, dict):
                    raise ConfigError(f"{path}: [{section}] must be a table")
                for k, v in value.items():
                    line = _line_of(text, f"[{section}]", k)
                    at = f"{path}{f':{line}' if line else ''}"
                    if k not in SECTIONS[section]:
                        raise ConfigError(
                            f"{at}: " + _known("key", k, list(SECTIONS[section]), f"[{section}]")
                        )
                    settings[section][k] = coerce(v, SECTIONS[section][k], f"{at}: [{section}] {k}")
                    sources[f"{section}.{k}"] = path
            elif section in TABLES:
                if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
                    raise ConfigError(f"{path}: {section} must be [[{section}]] tables")
                tables[section] = value
            else:
                raise ConfigError(f"{path}: " + _known("section", section, [*SECTIONS, *TABLES]))
    for section, keys in SECTIONS.items():
        for k, key in keys.items():
            name = env_name(section, k)
            if env.get(name, "") != "":
                settings[section][k] = parse_text(env[name], key, f"${name}")
                sources[f"{section}.{k}"] = f"${name}"
    for name, text_value in parse_set(list(sets)).items():
        section, k = name.split(".", 1)
        settings[section][k] = parse_text(text_value, SECTIONS[section][k], f"--set {name}")
        sources[name] = "--set"
    for name, value in (flags or {}).items():
        if value is None:
            continue
        section, k = name.split(".", 1)
        key = SECTIONS[section][k]
        settings[section][k] = coerce(value, key, f"{key.flag or name}")
        sources[name] = key.flag or name
    state_dir = settings["cluster"]["state_dir"]
    if not state_dir:
        raise ConfigError(f"{sources['cluster.state_dir']}: state_dir must not be empty")
    if not os.path.isabs(state_dir):
        rel_to = base_dir if sources["cluster.state_dir"] == path else os.getcwd()
        state_dir = os.path.normpath(os.path.join(rel_to, state_dir))
    settings["cluster"]["state_dir"] = state_dir
    resolved = {
        name: _check_table(name, rows, settings, where, text) for name, rows in tables.items()
    }
    if resolved.get("engines") and sources["defaults.layout"] == "default":
        # engines register their own layouts: a node names one only if its table does
        for raw, n in zip(tables["node"], resolved["node"]):
            if "layout" not in raw:
                n["layout"] = NO_LAYOUT
    nodes = [
        NodeSpec(
            id=n["id"],
            role=n["role"],
            layout="" if n["layout"] == NO_LAYOUT else n["layout"],
            dram=n["dram"],
            ssd=n["ssd"],
            settings=n,
        )
        for n in resolved["node"]
    ]
    c = settings["cluster"]
    return ClusterConfig(
        host=c["host"],
        state_dir=state_dir,
        token=c["token"] or None,
        transport=c["transport"],
        policy=settings["conductor"]["policy"],
        nodes=nodes,
        conductor_args=list(settings["conductor"]["args"]),
        tls=c["tls"],
        settings=settings,
        sources=sources,
        tables=resolved,
        path=path,
    )


def _check_table(
    name: str,
    rows: list[dict[str, Any]],
    settings: dict[str, dict[str, Any]],
    where: str,
    text: str,
) -> list[dict[str, Any]]:
    """Check each ``[[name]]`` table's keys and fill its unset ones; ``text``: the file's, to
    name the line of an error ("" when the tables are the defaults)."""
    schema = TABLES[name]
    out = []
    for i, row in enumerate(rows):
        label = f"[[{name}]] #{i + 1}" + (f" (id {row['id']!r})" if "id" in row else "")

        def at(key: str, i: int = i, label: str = label) -> str:
            line = _line_of(text, f"[[{name}]]", key, i) if text else None
            return f"{where}{f':{line}' if line else ''}: {label}"

        for k in row:
            if k not in schema:
                raise ConfigError(f"{at(k)}: " + _known("key", k, list(schema)))
        full: dict[str, Any] = {}
        for k, key in schema.items():
            if k in row:
                full[k] = coerce(row[k], key, f"{at(k)} {k}")
            elif key.required:
                raise ConfigError(f"{at('id')}: every [[{name}]] needs {k!r}")
            elif key.inherit is not None:
                full[k] = settings["defaults"][key.inherit]
            else:
                full[k] = key.default
        out.append(full)
    ids = [r["id"] for r in out if "id" in r]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ConfigError(f"{where}: [[{name}]] ids must be unique; {', '.join(dup)} repeat")
    for r in out:
        if "id" in r and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", r["id"]):
            raise ConfigError(
                f"{where}: [[{name}]] id {r['id']!r}: use letters, digits, '_', '.', '-'"
            )
    return out


# ---- showing the merged result ------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's


def render(cfg: ClusterConfig) -> str:
    """The merged config as TOML, each value not from the defaults followed by its source."""
    lines: list[str] = []
    for section, keys in SECTIONS.items():
        lines.append(f"[{section}]")
        for k in keys:
            value = cfg.settings[section][k]
            src = cfg.sources.get(f"{section}.{k}", "default")
            shown = '"***"' if k == "token" and value else _toml_value(value)
            note = "" if src == "default" else f"  # {src}"
            lines.append(f"{k} = {shown}{note}")
        lines.append("")
    for name, rows in cfg.tables.items():
        for row in rows:
            lines.append(f"[[{name}]]")
            # None: unset, taken from elsewhere (an [[engines]] key from [engine_defaults])
            lines += [f"{k} = {_toml_value(v)}" for k, v in row.items() if v is not None]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def add_flags(parser: Any) -> None:
    """``--config``, ``--set`` and each key's dedicated flag (dest ``cfg:SECTION.KEY``)."""
    import argparse

    parser.add_argument(
        "--config",
        default=os.environ.get(ENV_PREFIX + "CONFIG") or None,
        help="cluster TOML (default: $KVCACHE_CONFIG, else the embedded defaults)",
    )
    parser.add_argument(
        "--set",
        dest="config_set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="set any config key (repeatable), e.g. --set conductor.policy=load",
    )
    for section, keys in SECTIONS.items():
        for k, key in keys.items():
            if key.flag is None:
                continue
            kw: dict[str, Any] = {
                "dest": f"cfg:{section}.{k}",
                "default": None,
                "help": f"{key.help} (config [{section}] {k}, ${env_name(section, k)})",
            }
            if key.type is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = key.type
                if key.choices:
                    kw["choices"] = key.choices
            parser.add_argument(key.flag, **kw)


def flags_of(args: Any) -> dict[str, Any]:
    return {d[4:]: v for d, v in vars(args).items() if d.startswith("cfg:")}


def from_args(args: Any) -> ClusterConfig:
    return load_config(args.config, flags=flags_of(args), sets=args.config_set)
