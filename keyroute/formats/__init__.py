"""Formats: how a stored value is written on the wire (JSON, Avro, Protobuf text) and typed.
"""
