"""docs/reference/settings.md: every setting of every service, from the config classes' field docs."""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ._markdown import cell, generated_banner

# (config class, console script): the services a deployment runs, in the order a sample meets them.
SERVICES = (
    ("rlfleet.services.collector.config:CollectorConfig", "rlfleet-collector"),
    ("rlfleet.services.generation.config:GenerationConfig", "rlfleet-generation"),
    ("rlfleet.services.environment.config:EnvironmentServiceConfig", "rlfleet-environment"),
    ("rlfleet.services.reference.config:ReferenceServiceConfig", "rlfleet-reference"),
    ("rlfleet.services.reward.config:RewardServiceConfig", "rlfleet-reward"),
    ("rlfleet.services.trajectory.config:TrajectoryConfig", "rlfleet-trajectory"),
    ("rlfleet.services.viewer.config:ViewerConfig", "rlfleet-viewer"),
)
COMMON = "rlfleet.services.common.config:ServiceConfig"


def load(path: str) -> type[BaseModel]:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def type_name(annotation) -> str:
    """The field's type as a reader writes it: ``int``, ``str | None``, ``"FULL" | "NORMAL"``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else origin.__name__
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        return json.dumps(value, sort_keys=True)
    except TypeError:
        return str(value)


def doc_text(cls: type[BaseModel], name: str) -> str:
    description = cls.model_fields[name].description or ""
    return inspect.cleandoc(description).replace("``", "`")


def table(cls: type[BaseModel], names: list[str], env_prefix: str) -> list[str]:
    lines = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    for name in names:
        field = cls.model_fields[name]
        env = f"{env_prefix}{name.upper()}" if env_prefix else f"RLFLEET_<SERVICE>_{name.upper()}"
        lines.append(f"| `{name}`<br><small>`--{name.replace('_', '-')}`<br>`{env}`</small> | "
                     f"{cell('`' + type_name(field.annotation) + '`')} | {cell('`' + default_text(field) + '`')} | "
                     f"{cell(doc_text(cls, name))} |")
    return lines


def render() -> dict[str, str]:
    common = load(COMMON)
    lines = [*generated_banner("scripts/gen_docs/settings.py", "the services' config classes"),
             "# Settings", "",
             "Every service has one pydantic config (`services/<service>/config.py`). A value comes from, "
             "highest first: a CLI flag (`--field-name VALUE`), an environment variable "
             "`RLFLEET_<SERVICE>_<FIELD>`, a `--config file.yaml|json`, the default. Dict and list settings "
             "take JSON in flags and variables; on the command line `null` unsets an optional one. A bad "
             "value stops the service at start with exit code 2, naming the setting.", "",
             "## Every service", "",
             "These apply to each gRPC service below (its own default `port` is in its table); the rollout "
             "viewer, a web server, has its own list.", ""]
    common_names = list(common.model_fields)
    lines += table(common, common_names, "")
    for path, script in SERVICES:
        cls = load(path)
        prefix = cls.env_prefix() if hasattr(cls, "env_prefix") else f"RLFLEET_{cls.service_name.upper()}_"
        # A gRPC service lists what it adds to the common fields; another process (the viewer) all of its own.
        shared = common.model_fields if issubclass(cls, common) else {}
        own = [n for n in cls.model_fields if n not in shared or n == "port"]
        summary = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        lines += ["", f"## {cls.service_name}", "",
                  f"`{script}` · `python -m rlfleet.services.{cls.service_name}` · variables `{prefix}<FIELD>` · "
                  f"{len(own)} settings of its own", "", summary.replace("``", "`"), ""]
        lines += table(cls, own, prefix)
    return {"reference/settings.md": "\n".join(lines) + "\n"}
