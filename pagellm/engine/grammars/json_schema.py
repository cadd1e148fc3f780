"""JSON schemas as the grammar backends take them: normalised so that no backend drops a
constraint by the way it is written, and scanned for the keywords a backend does not enforce.

Normalisation merges `allOf` into its parent where the merge is exact: each member (a local `$ref`
resolved to its target) adds its properties, its `required` names and any keyword the parent
lacks; a keyword both set to different values leaves that `allOf` as it was. A `$ref` beside
other keywords (allowed since draft 2019-09) is read as an `allOf` of the two. A backend that
compiles `allOf` of a `$ref` by the referenced schema alone would otherwise drop the parent's
`required` list silently.
"""
from __future__ import annotations

import copy
from typing import Any, Iterator

# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that carry no constraint on the output.
ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "title", "description", "default", "examples",
                         "deprecated", "readOnly", "writeOnly", "$anchor", "contentMediaType", "contentEncoding"})


def subschemas(schema: Any) -> Iterator[dict]:
    """`schema` and every schema nested in it (not property names or enum values)."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key in _ONE:
        yield from subschemas(schema.get(key))
    for key in _LIST:
        value = schema.get(key)
        if isinstance(value, list):
            for item in value:
                yield from subschemas(item)
    if isinstance(schema.get("items"), list):  # draft-04 tuple form
        for item in schema["items"]:
            yield from subschemas(item)
    for key in _MAP:
        value = schema.get(key)
        if isinstance(value, dict):
            for item in value.values():
                yield from subschemas(item)


def keywords(schema: Any) -> set[str]:
    """Every keyword used by `schema` or a schema nested in it."""
    return {key for s in subschemas(schema) for key in s}


def features(schema: Any) -> set[str]:
    """What `schema` asks of an output, as the backends' UNENFORCED tables name it: every keyword
    with a value that constrains, and the combinations a backend treats apart from the keywords
    alone ("pattern with minLength/maxLength", "format with minLength/maxLength", "multipleOf on
    numbers")."""
    used = set()
    for s in subschemas(schema):
        used |= {k for k in s if k not in ANNOTATIONS and not (k == "uniqueItems" and s[k] is False)}
        bounded = "minLength" in s or "maxLength" in s
        for key in ("pattern", "format"):
            if key in s and bounded:
                used.add(f"{key} with minLength/maxLength")
        if "multipleOf" in s and (s.get("type") != "integer" or not float(s["multipleOf"]).is_integer()):
            used.add("multipleOf on numbers")
    return used


def unenforced_keywords(schema_json: str | dict, candidates: frozenset[str]) -> set[str]:
    """The features (`features`) of the schema that are among `candidates`."""
    import json

    schema = json.loads(schema_json) if isinstance(schema_json, str) else schema_json
    return features(schema) & candidates


def _resolve(root: dict, ref: str) -> dict | None:
    """The target of a local reference ("#/$defs/Name", "#/definitions/Name", "#"), or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) else None


def _merge_into(parent: dict, member: dict) -> bool:
    """Add `member`'s constraints to `parent` in place if that is exact; False (parent unchanged
    in what matters: the caller works on a copy) if two values conflict."""
    for key, value in member.items():
        if key in ANNOTATIONS or key in ("$defs", "definitions"):
            continue
        if key == "properties" and isinstance(value, dict):
            props = parent.setdefault("properties", {})
            for name, sub in value.items():
                if name in props and props[name] != sub:
                    return False
                props[name] = sub
        elif key == "required" and isinstance(value, list):
            required = parent.setdefault("required", [])
            required += [r for r in value if r not in required]
        elif key in parent and parent[key] != value:
            return False
        else:
            parent[key] = value
    return True


def normalize_schema(schema: Any) -> Any:
    """A copy of `schema` with `allOf` merged into its parents where exact (module docstring)."""
    root = copy.deepcopy(schema)
    if not isinstance(root, dict):
        return root
    for s in list(subschemas(root)):
        if "$ref" in s and set(s) - ANNOTATIONS - {"$ref", "$defs", "definitions"}:
            ref = s.pop("$ref")
            rest = {k: s.pop(k) for k in list(s) if k not in ANNOTATIONS and k not in ("$defs", "definitions")}
            s["allOf"] = [{"$ref": ref}, rest]
        members = s.get("allOf")
        if isinstance(members, list) and members:
            merged = _merged(root, s, members)
            if merged is not None:
                s.clear()
                s.update(merged)
    return root


def _merged(root: dict, parent: dict, members: list) -> dict | None:
    """`parent` with its `allOf` members merged in, or None where that would not be exact."""
    merged = {k: copy.deepcopy(v) for k, v in parent.items() if k != "allOf"}
    resolved = []
    for member in members:
        if isinstance(member, dict) and set(member) - ANNOTATIONS == {"$ref"}:
            target = _resolve(root, member["$ref"])
            if target is None or target is parent or "allOf" in target or "$ref" in target:
                return None  # unresolvable or self-referential: left to the backend
            member = target
        if not isinstance(member, dict):
            return None
        resolved.append(member)
    # additionalProperties: false in one part rejects the properties another part adds: not a union.
    closed = [p for p in [merged, *resolved] if set(p) & {"additionalProperties", "patternProperties",
                                                              "unevaluatedProperties"}]
    with_properties = [p for p in [merged, *resolved] if "properties" in p]
    if closed and len(with_properties) > 1:
        return None
    for member in resolved:
        if not _merge_into(merged, copy.deepcopy(member)):
            return None
    return merged


def closed_by_default(schema: Any) -> Any:
    """A copy of `schema` in which an object schema with `properties` and no word on other keys
    admits no other keys, and a `prefixItems` without `items` no further items: what xgrammar's
    strict mode (and OpenAI's strict structured outputs) make of them, so that every backend
    produces the same outputs for one schema."""
    root = copy.deepcopy(schema)
    for s in subschemas(root):
        if isinstance(s.get("properties"), dict) and not set(s) & {"additionalProperties", "patternProperties",
                                                                   "unevaluatedProperties"}:
            s["additionalProperties"] = False
        if isinstance(s.get("prefixItems"), list) and not set(s) & {"items", "unevaluatedItems"}:
            s["items"] = False
    return root
