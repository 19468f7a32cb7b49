"""docs/reference/api.md: every service, RPC, message, enum and field of the protobuf API, from the
descriptors protoc builds from ``protos/`` with their comments (source info)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

from ._markdown import cell, generated_banner

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"

# FieldDescriptorProto.Type -> the name a .proto file uses.
_SCALARS = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in descriptor_pb2.FieldDescriptorProto.Type.items()
}
# Paths into FileDescriptorProto (descriptor.proto's field numbers) for SourceCodeInfo lookups.
_MESSAGE, _ENUM, _SERVICE = 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM, _VALUE, _METHOD = 2, 3, 4, 2, 2


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    files = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "rlfleet" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "api.pb"
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}", "--include_source_info",
                        f"--descriptor_set_out={out}", *files], check=True)
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


class _Comments:
    def __init__(self, file: descriptor_pb2.FileDescriptorProto):
        self._by_path = {tuple(loc.path): _clean(loc.leading_comments or loc.trailing_comments)
                         for loc in file.source_code_info.location}

    def __call__(self, *path: int) -> str:
        return self._by_path.get(path, "")


def _clean(comment: str) -> str:
    """A comment's text without the space each ``// `` line starts with."""
    return "\n".join(line[1:] if line.startswith(" ") else line for line in comment.split("\n")).strip()


def _field_type(field: descriptor_pb2.FieldDescriptorProto, maps: dict[str, str]) -> str:
    if field.type_name:
        name = field.type_name.removeprefix(".rlfleet.v1.").removeprefix(".")
        if name in maps:
            return maps[name]
        text = f"`{name}`" if name.startswith("google.") else f"[`{name}`](#{_anchor(name)})"
    else:
        text = f"`{_SCALARS[field.type]}`"
    if field.label == field.LABEL_REPEATED:
        return f"repeated {text}"
    if field.proto3_optional:
        return f"optional {text}"
    return text


def _anchor(name: str) -> str:
    return name.lower().replace(".", "")


def _map_entries(message: descriptor_pb2.DescriptorProto, prefix: str, out: dict[str, str]) -> None:
    for nested in message.nested_type:
        full = f"{prefix}.{nested.name}"
        if nested.options.map_entry:
            key, value = nested.field
            out[full] = f"map<{_field_type(key, {})}, {_field_type(value, {})}>"
        else:
            _map_entries(nested, full, out)


def _message(message, path, prefix, comments, maps, lines) -> None:
    full = f"{prefix}{message.name}"
    lines += [f"### {full}", "", comments(*path) or "*(no comment)*", ""]
    oneofs = {i: decl.name for i, decl in enumerate(message.oneof_decl)}
    if message.field:
        lines += ["| field | number | type | meaning |", "|---|---|---|---|"]
        for j, field in enumerate(message.field):
            where = ""
            if field.HasField("oneof_index") and not field.proto3_optional:
                where = f" <small>(one of `{oneofs[field.oneof_index]}`)</small>"
            lines.append(f"| `{field.name}`{where} | {field.number} | {_field_type(field, maps)} | "
                         f"{cell(comments(*path, _FIELD, j))} |")
        lines.append("")
    for k, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            _message(nested, (*path, _NESTED, k), f"{full}.", comments, maps, lines)
    for k, enum in enumerate(message.enum_type):
        _enum(enum, (*path, _NESTED_ENUM, k), f"{full}.", comments, lines)


def _enum(enum, path, prefix, comments, lines) -> None:
    lines += [f"### {prefix}{enum.name}", "", comments(*path) or "*(no comment)*", "",
              "| value | number | meaning |", "|---|---|---|"]
    for j, value in enumerate(enum.value):
        lines.append(f"| `{value.name}` | {value.number} | {cell(comments(*path, _VALUE, j))} |")
    lines.append("")


def _service(service, path, comments, lines) -> None:
    lines += [f"### {service.name}", "", comments(*path) or "*(no comment)*", "",
              "| RPC | request | response | what it does |", "|---|---|---|---|"]
    for j, method in enumerate(service.method):
        request = method.input_type.removeprefix(".rlfleet.v1.")
        response = method.output_type.removeprefix(".rlfleet.v1.")
        request_text = ("stream " if method.client_streaming else "") + _type_link(request)
        response_text = ("stream " if method.server_streaming else "") + _type_link(response)
        lines.append(f"| `{method.name}` | {request_text} | {response_text} | {cell(comments(*path, _METHOD, j))} |")
    lines.append("")


def _type_link(name: str) -> str:
    return f"`{name}`" if name.startswith(".") else f"[`{name}`](#{_anchor(name)})"


def render() -> dict[str, str]:
    files = [f for f in descriptor_set().file if f.package == "rlfleet.v1"]
    lines = [*generated_banner("scripts/gen_docs/api.py", "protos/rlfleet/v1/*.proto and their comments"),
             "# gRPC API", "",
             "Package `rlfleet.v1`. Trainers call the collector (`CollectorService`) through the SDK; the "
             "other services are the collector's upstreams. Python stubs: `rlfleet.v1` (`client/rlfleet/v1`). "
             "Tensors travel as TensorDicts in the wire format (Concepts → Wire format).", "",
             "| file | services | messages | enums |", "|---|---|---|---|"]
    for file in files:
        name = Path(file.name).name
        lines.append(f"| [`{name}`](#{_anchor(name)}) | {len(file.service)} | "
                     f"{len(file.message_type)} | {len(file.enum_type)} |")
    lines.append("")
    for file in files:
        comments = _Comments(file)
        maps: dict[str, str] = {}
        for message in file.message_type:
            _map_entries(message, message.name, maps)
        # The file's own comment is the one on `package` (path [2]); `syntax` may carry it too.
        intro = comments(2) or comments(12)
        lines += [f"## {Path(file.name).name}", "", f"`protos/{file.name}`", "", *([intro, ""] if intro else [])]
        for i, service in enumerate(file.service):
            _service(service, (_SERVICE, i), comments, lines)
        for i, message in enumerate(file.message_type):
            _message(message, (_MESSAGE, i), "", comments, maps, lines)
        for i, enum in enumerate(file.enum_type):
            _enum(enum, (_ENUM, i), "", comments, lines)
    return {"reference/api.md": "\n".join(lines) + "\n"}
