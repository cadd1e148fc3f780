"""A corpus of JSON schemas for `pagellm bench grammar --corpus`: every keyword of JSON Schema
2020-12 that constrains an output, alone and in the shapes real clients send (function-calling
arguments, configuration files, API payloads), each named for what it exercises.

Each entry is (name, schema). Schemas are small on purpose: a 135M model must be able to finish
them within the bench's token budget, so that invalid outputs show up as such rather than as
truncations.
"""
from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            **extra}


_FORMATS = ["date", "date-time", "time", "email", "uuid", "ipv4", "ipv6", "hostname", "uri", "duration"]

_STRINGS = [
    ("string-min-max-length", {"type": "string", "minLength": 3, "maxLength": 8}),
    ("string-exact-length", {"type": "string", "minLength": 5, "maxLength": 5}),
    ("string-pattern-code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    ("string-pattern-unanchored", {"type": "string", "pattern": "[0-9]{4}", "maxLength": 12}),
    ("string-pattern-alternation", {"type": "string", "pattern": "^(red|green|blue)(-dark)?$"}),
    ("string-enum", {"enum": ["alpha", "beta", "gamma"]}),
    ("string-const", {"const": "fixed"}),
    ("string-or-null", {"type": ["string", "null"], "maxLength": 10}),
]

_NUMBERS = [
    ("integer-bounds", {"type": "integer", "minimum": -5, "maximum": 5}),
    ("integer-exclusive-bounds", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("integer-large-bounds", {"type": "integer", "minimum": 1000, "maximum": 99999}),
    ("number-bounds", {"type": "number", "minimum": 1.5, "maximum": 2.5}),
    ("number-exclusive-bounds", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("number-negative-range", {"type": "number", "minimum": -100, "maximum": -10}),
    ("integer-multiple-of", {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100}),
    ("number-multiple-of", {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10}),
    ("integer-enum", {"enum": [1, 2, 3, 5, 8]}),
    ("boolean", {"type": "boolean"}),
    ("null", {"type": "null"}),
    ("number-or-string", {"type": ["number", "string"], "maxLength": 6}),
]

_ARRAYS = [
    ("array-min-max-items", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}),
    ("array-exact-items", {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}),
    ("array-of-objects", {"type": "array", "items": _obj({"id": {"type": "integer"}, "ok": {"type": "boolean"}}),
                          "minItems": 1, "maxItems": 3}),
    ("array-prefix-items", {"type": "array", "prefixItems": [{"type": "string", "maxLength": 5}, {"type": "integer"}],
                            "items": False}),
    ("array-prefix-then-items", {"type": "array", "prefixItems": [{"const": "head"}],
                                 "items": {"type": "integer"}, "maxItems": 4}),
    ("array-unique-items", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
                            "minItems": 3, "maxItems": 4, "uniqueItems": True}),
    ("array-contains", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "contains": {"const": 7}, "minItems": 1, "maxItems": 5}),
    ("array-min-max-contains", {"type": "array", "items": {"enum": ["a", "b"]}, "contains": {"const": "a"},
                                "minContains": 2, "maxContains": 2, "maxItems": 4}),
    ("array-nested", {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                      "minItems": 1, "maxItems": 3}),
    ("array-enum-items", {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 5}),
]

_OBJECTS = [
    ("object-required-subset", _obj({"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8},
                                     "c": {"type": "boolean"}}, ["a"])),
    ("object-no-required", _obj({"a": {"type": "integer"}, "b": {"type": "boolean"}}, [])),
    ("object-additional-false", _obj({"a": {"type": "integer"}}, additionalProperties=False)),
    ("object-additional-schema", {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3}),
    ("object-pattern-properties", {"type": "object", "patternProperties": {"^x_[0-9]$": {"type": "integer"}},
                                   "additionalProperties": False, "minProperties": 1, "maxProperties": 3}),
    ("object-min-max-properties", {"type": "object", "additionalProperties": {"type": "boolean"},
                                   "minProperties": 2, "maxProperties": 3}),
    ("object-property-names", {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,3}$"},
                               "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 3}),
    ("object-dependent-required", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                   "dependentRequired": {"a": ["b"]}, "additionalProperties": False}),
    ("object-dependent-schemas", {"type": "object", "properties": {"card": {"type": "string", "maxLength": 6},
                                                                   "cvc": {"type": "integer"}},
                                  "dependentSchemas": {"card": {"required": ["cvc"]}}, "additionalProperties": False}),
    ("object-unevaluated-properties", {"type": "object", "properties": {"a": {"type": "integer"}},
                                       "unevaluatedProperties": False, "required": ["a"]}),
    ("object-nested-three", _obj({"outer": _obj({"middle": _obj({"inner": {"type": "integer"}})})})),
    ("object-empty", {"type": "object", "additionalProperties": False}),
]

_COMPOSITION = [
    ("anyof-types", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}),
    ("anyof-objects", {"anyOf": [_obj({"cat": {"const": "meow"}}), _obj({"dog": {"const": "woof"}})]}),
    ("oneof-disjoint", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}),
    ("oneof-overlapping", {"oneOf": [{"type": "integer", "maximum": 10}, {"type": "integer", "minimum": 5}]}),
    ("oneof-tagged", {"oneOf": [_obj({"kind": {"const": "circle"}, "r": {"type": "number"}}),
                                _obj({"kind": {"const": "square"}, "side": {"type": "number"}})]}),
    ("allof-merge-properties", {"allOf": [_obj({"a": {"type": "integer"}}), _obj({"b": {"type": "boolean"}})]}),
    ("allof-ref-with-required", {"$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                     "b": {"type": "string",
                                                                                           "maxLength": 5}}}},
                                 "allOf": [{"$ref": "#/$defs/base"}], "required": ["a", "b"]}),
    ("allof-definitions-ref-required", {"definitions": {"p": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}}}},
        "type": "object", "allOf": [{"$ref": "#/definitions/p"}], "required": ["name", "age"]}),
    ("ref-beside-required", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                             "y": {"type": "integer"}}}},
                             "$ref": "#/$defs/pt", "required": ["x", "y"]}),
    ("allof-bounds", {"allOf": [{"type": "integer", "minimum": 3}, {"type": "integer", "maximum": 6}]}),
    ("not-enum", {"type": "integer", "minimum": 0, "maximum": 9, "not": {"enum": [0, 1, 2, 3, 4]}}),
    ("if-then-else", {"type": "object", "properties": {"kind": {"enum": ["a", "b"]},
                                                       "v": {"type": ["string", "integer"], "maxLength": 4}},
                      "required": ["kind", "v"], "additionalProperties": False,
                      "if": {"properties": {"kind": {"const": "a"}}},
                      "then": {"properties": {"v": {"type": "string"}}},
                      "else": {"properties": {"v": {"type": "integer"}}}}),
    ("enum-mixed", {"enum": ["on", 1, None, True]}),
    ("const-object", {"const": {"a": 1}}),
]

_REFS = [
    ("ref-defs", {"$defs": {"id": {"type": "integer", "minimum": 1}}, "type": "object",
                  "properties": {"a": {"$ref": "#/$defs/id"}, "b": {"$ref": "#/$defs/id"}}, "required": ["a", "b"]}),
    ("ref-definitions", {"definitions": {"tag": {"type": "string", "maxLength": 4}}, "type": "array",
                         "items": {"$ref": "#/definitions/tag"}, "maxItems": 3}),
    ("ref-recursive-tree", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"]}}, "$ref": "#/$defs/node"}),
    ("ref-recursive-list", {"$defs": {"cell": {"type": "object", "properties": {
        "head": {"type": "integer"}, "tail": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/cell"}]}},
        "required": ["head", "tail"]}}, "$ref": "#/$defs/cell"}),
    ("ref-root-recursion", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                            "child": {"$ref": "#"}}, "required": ["name"]}),
    ("ref-nested-defs", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer", "maximum": 9}},
                         "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}),
]

_REAL = [
    ("tool-get-weather", _obj({"location": {"type": "string", "description": "City and country", "maxLength": 24},
                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location"],
                              additionalProperties=False)),
    ("tool-search", _obj({"query": {"type": "string", "maxLength": 30}, "limit": {"type": "integer", "minimum": 1,
                                                                               "maximum": 20},
                          "filters": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
                         ["query"])),
    ("tool-send-email", _obj({"to": {"type": "string", "format": "email"}, "subject": {"type": "string",
                                                                                     "maxLength": 20},
                              "cc": {"type": "array", "items": {"type": "string", "format": "email"},
                                     "maxItems": 2}}, ["to", "subject"])),
    ("tool-create-event", _obj({"title": {"type": "string", "maxLength": 20}, "start": {"type": "string",
                                                                                       "format": "date-time"},
                                "attendees": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                              "maxItems": 3}}, ["title", "start"])),
    ("tool-run-sql", _obj({"query": {"type": "string", "pattern": "^SELECT [a-z_*, ]{1,20} FROM [a-z_]{1,12}$"},
                           "timeout_s": {"type": "number", "minimum": 0.1, "maximum": 30}}, ["query"])),
    ("k8s-container", _obj({"name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,10}$"},
                            "image": {"type": "string", "maxLength": 24},
                            "ports": {"type": "array", "items": _obj({"containerPort": {
                                "type": "integer", "minimum": 1, "maximum": 65535},
                                "protocol": {"enum": ["TCP", "UDP"]}}, ["containerPort"]), "maxItems": 2}},
                           ["name", "image"])),
    ("k8s-resources", _obj({"limits": {"type": "object", "properties": {"cpu": {"type": "string",
                                                                               "pattern": "^[0-9]{1,3}m$"},
                                                                       "memory": {"type": "string",
                                                                                  "pattern": "^[0-9]{1,4}Mi$"}},
                                       "additionalProperties": False}}, ["limits"])),
    ("package-json", _obj({"name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,12}$"},
                           "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
                           "private": {"type": "boolean"},
                           "dependencies": {"type": "object", "additionalProperties": {"type": "string",
                                                                                       "maxLength": 8},
                                            "maxProperties": 2}}, ["name", "version"])),
    ("geojson-point", _obj({"type": {"const": "Point"}, "coordinates": {
        "type": "array", "prefixItems": [{"type": "number", "minimum": -180, "maximum": 180},
                                         {"type": "number", "minimum": -90, "maximum": 90}],
        "minItems": 2, "maxItems": 2}})),
    ("invoice", _obj({"number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                      "date": {"type": "string", "format": "date"},
                      "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": _obj({
                          "sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer", "minimum": 1},
                          "price": {"type": "number", "minimum": 0}})},
                      "paid": {"type": "boolean"}})),
    ("user-profile", _obj({"id": {"type": "string", "format": "uuid"}, "name": {"type": "string", "maxLength": 12},
                           "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 130},
                           "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3}},
                          ["id", "name"])),
    ("github-issue", _obj({"title": {"type": "string", "maxLength": 24},
                           "labels": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                           "state": {"enum": ["open", "closed"]}, "number": {"type": "integer", "minimum": 1}},
                          ["title", "state"])),
    ("product-catalog", {"type": "array", "maxItems": 2, "items": _obj({
        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}}, ["sku", "price"])}),
    ("server-config", _obj({"host": {"type": "string", "format": "hostname", "maxLength": 20},
                            "port": {"type": "integer", "minimum": 1024, "maximum": 65535},
                            "tls": _obj({"enabled": {"type": "boolean"}, "cert": {"type": "string", "maxLength": 16}},
                                        ["enabled"]),
                            "log_level": {"enum": ["debug", "info", "warn", "error"]}}, ["host", "port"])),
    ("classification", _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                             "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("extraction-entities", _obj({"entities": {"type": "array", "maxItems": 3, "items": _obj({
        "text": {"type": "string", "maxLength": 12}, "type": {"enum": ["PER", "ORG", "LOC"]},
        "start": {"type": "integer", "minimum": 0}})}})),
    ("chain-of-thought", _obj({"steps": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                         "minItems": 1, "maxItems": 3},
                               "answer": {"type": "integer"}})),
    ("openapi-parameter", _obj({"name": {"type": "string", "maxLength": 10}, "in": {"enum": ["query", "path",
                                                                                          "header"]},
                                "required": {"type": "boolean"},
                                "schema": _obj({"type": {"enum": ["string", "integer"]}})}, ["name", "in"])),
    ("nullable-fields", _obj({"a": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                              "b": {"type": ["string", "null"], "maxLength": 5}})),
    ("date-range", _obj({"from": {"type": "string", "format": "date"}, "to": {"type": "string", "format": "date"}})),
    ("color-rgb", _obj({"rgb": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 255}] * 3,
                                "items": False, "minItems": 3}})),
    ("tool-calls-array", {"type": "array", "maxItems": 2, "items": _obj({
        "name": {"enum": ["get_time", "get_weather"]},
        "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                      "additionalProperties": False}})}),
]


def corpus() -> list[tuple[str, dict]]:
    """Every schema of the corpus, named."""
    entries = [(f"format-{f}", {"type": "string", "format": f}) for f in _FORMATS]
    entries += [(f"object-of-{name}", _obj({"value": schema})) for name, schema in _STRINGS + _NUMBERS]
    entries += _STRINGS + _NUMBERS + _ARRAYS + _OBJECTS + _COMPOSITION + _REFS + _REAL
    names = [n for n, _ in entries]
    assert len(names) == len(set(names)), "corpus names are unique"
    return entries
