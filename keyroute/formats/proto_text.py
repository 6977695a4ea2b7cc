"""A .proto text (as a Schema Registry answers Protobuf schemas by default, and as producers in other languages
register them) made into a FileDescriptorProto at run time, so its message classes can be built without
protoc or generated code.

The text is parsed by proto-schema-parser (pure Python); type names are written as they appear in the text and
resolved, like protoc resolves them, by the descriptor pool the file is added to (with the files it imports).
Covered: proto2 and proto3 syntax, packages, imports, messages (nested), enums, scalar, message and enum
fields with their cardinality (proto3 `optional` included), maps and oneofs. Options, services, extensions and
reserved ranges change nothing a reader of values needs, and are left out.
"""

from __future__ import annotations

from typing import Any

# Scalar types by name, with their FieldDescriptorProto.Type numbers.
_SCALARS = {
    "double": 1,
    "float": 2,
    "int64": 3,
    "uint64": 4,
    "int32": 5,
    "fixed64": 6,
    "fixed32": 7,
    "bool": 8,
    "string": 9,
    "bytes": 12,
    "uint32": 13,
    "sfixed32": 15,
    "sfixed64": 16,
    "sint32": 17,
    "sint64": 18,
}


def parse_proto_text(text: str, name: str) -> Any:
    """The FileDescriptorProto of a .proto text (`name` its file name); ValueError when it does not parse."""
    from google.protobuf import descriptor_pb2
    from proto_schema_parser import ast
    from proto_schema_parser.parser import Parser

    try:
        tree = Parser().parse(text)
    except Exception as exc:  # the parser's own errors
        raise ValueError(f"not a .proto text: {exc}") from None
    syntax = tree.syntax or "proto2"
    proto = descriptor_pb2.FileDescriptorProto(name=name, syntax=syntax)
    builder = _Builder(ast, descriptor_pb2.FieldDescriptorProto, proto3=syntax == "proto3")
    for element in tree.file_elements:
        if isinstance(element, ast.Package):
            proto.package = element.name
        elif isinstance(element, ast.Import):
            proto.dependency.append(element.name)
        elif isinstance(element, ast.Message):
            builder.message(proto.message_type.add(name=element.name), element)
        elif isinstance(element, ast.Enum):
            builder.enum(proto.enum_type.add(name=element.name), element)
    return proto


class _Builder:
    def __init__(self, ast: Any, field_proto: Any, proto3: bool) -> None:
        self.ast = ast
        self.F = field_proto
        self.proto3 = proto3

    def field(self, message: Any, name: str, number: int, type_: str, cardinality: Any = None) -> Any:
        F, ast = self.F, self.ast
        out = message.field.add(name=name, number=number)
        if type_ in _SCALARS:
            out.type = _SCALARS[type_]
        else:
            out.type_name = type_  # resolved by the pool (a message or an enum)
        if cardinality == ast.FieldCardinality.REPEATED:
            out.label = F.LABEL_REPEATED
        elif cardinality == ast.FieldCardinality.REQUIRED:
            out.label = F.LABEL_REQUIRED
        else:
            out.label = F.LABEL_OPTIONAL
            if cardinality == ast.FieldCardinality.OPTIONAL and self.proto3:
                out.proto3_optional = True
        return out

    def message(self, out: Any, node: Any) -> None:
        ast = self.ast
        for element in node.elements:
            if isinstance(element, ast.Field):
                self.field(out, element.name, element.number, element.type, element.cardinality)
            elif isinstance(element, ast.Message):
                self.message(out.nested_type.add(name=element.name), element)
            elif isinstance(element, ast.Enum):
                self.enum(out.enum_type.add(name=element.name), element)
            elif isinstance(element, ast.MapField):
                entry = out.nested_type.add(
                    name="".join(p[:1].upper() + p[1:] for p in element.name.split("_")) + "Entry"
                )
                entry.options.map_entry = True
                self.field(entry, "key", 1, element.key_type)
                self.field(entry, "value", 2, element.value_type)
                self.field(out, element.name, element.number, entry.name, ast.FieldCardinality.REPEATED)
            elif isinstance(element, ast.OneOf):
                index = len(out.oneof_decl)
                out.oneof_decl.add(name=element.name)
                for member in element.elements:
                    if isinstance(member, ast.Field):
                        self.field(out, member.name, member.number, member.type).oneof_index = index
        for field in out.field:  # proto3 `optional`: a synthetic oneof each, after the real ones
            if field.proto3_optional:
                field.oneof_index = len(out.oneof_decl)
                out.oneof_decl.add(name="_" + field.name)

    def enum(self, out: Any, node: Any) -> None:
        for value in node.elements:
            if isinstance(value, self.ast.EnumValue):
                out.value.add(name=value.name, number=value.number)
