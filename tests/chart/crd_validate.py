"""Validate custom resources offline against CRD openAPIV3Schemas (KubeRay, in CI).

usage: crd_validate.py --crds DIR [--strict] [--require-all] manifest.yaml...

The CRD schemas are Kubernetes "structural" OpenAPI v3; we translate them to JSON Schema. With
--strict an object without `x-kubernetes-preserve-unknown-fields` rejects unknown fields, as the
API server does with `kubectl apply --validate=strict`. Documents of kinds without a CRD are
skipped (core kinds go through kubernetes-validate) unless --require-all names them errors.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator, FormatChecker

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_CORE_GROUPS = ("v1", "apps/v1", "batch/v1", "networking.k8s.io/v1", "policy/v1")


def to_jsonschema(node: object, strict: bool) -> object:
    """One structural-schema node -> JSON Schema (recursive)."""
    if not isinstance(node, dict):
        return node
    s = dict(node)
    if s.pop("x-kubernetes-int-or-string", False):
        s.pop("type", None)
        s["anyOf"] = [{"type": "integer"}, {"type": "string"}] + s.get("anyOf", [])
    if s.pop("nullable", False) and "type" in s:
        s["type"] = [s["type"], "null"]
    preserve = s.pop("x-kubernetes-preserve-unknown-fields", False)
    for key in [k for k in s if k.startswith("x-kubernetes-")]:
        s.pop(key)
    if "properties" in s:
        s["properties"] = {k: to_jsonschema(v, strict) for k, v in s["properties"].items()}
        if strict and not preserve and "additionalProperties" not in s:
            s["additionalProperties"] = False
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = to_jsonschema(s["additionalProperties"], strict)
    if "items" in s:
        s["items"] = to_jsonschema(s["items"], strict)
    for key in ("allOf", "anyOf", "oneOf"):
        if key in s:
            s[key] = [to_jsonschema(x, strict) for x in s[key]]
    if "not" in s:
        s["not"] = to_jsonschema(s["not"], strict)
    return s


def load_validators(crd_dir: str, strict: bool) -> dict[tuple[str, str], Draft202012Validator]:
    """(apiVersion, kind) -> validator for every served version of every CRD in `crd_dir`."""
    out = {}
    for path in sorted(glob.glob(f"{crd_dir}/*.yaml")):
        for doc in yaml.load_all(Path(path).read_text(), Loader=_LOADER):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                schema = to_jsonschema(version["schema"]["openAPIV3Schema"], strict)
                api_version = f"{group}/{version['name']}"
                # metadata stays loose (the API server fills it); apiVersion and kind are pinned.
                schema.setdefault("properties", {})["apiVersion"] = {"const": api_version}
                schema["properties"]["kind"] = {"const": kind}
                out[(api_version, kind)] = Draft202012Validator(
                    schema, format_checker=FormatChecker())
    return out


def validate_docs(docs: list[dict], validators: dict, require_all: bool = False) -> list[str]:
    """Error lines ('Kind/name: path: message'); empty when every custom resource is valid."""
    errors = []
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        name = f"{key[1]}/{doc.get('metadata', {}).get('name')}"
        if key not in validators:
            if require_all and key[0] not in _CORE_GROUPS:
                errors.append(f"{name}: no CRD schema for {key[0]}")
            continue
        for e in sorted(validators[key].iter_errors(doc), key=lambda e: list(e.absolute_path)):
            path = ".".join(map(str, e.absolute_path)) or "<root>"
            errors.append(f"{name}: {path}: {e.message[:300]}")
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crds", required=True)
    parser.add_argument("--strict", action="store_true", help="reject unknown fields")
    parser.add_argument("--require-all", action="store_true",
                        help="a non-core kind without a CRD schema is an error")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    validators = load_validators(args.crds, args.strict)
    failed = 0
    for path in args.files:
        docs = [d for d in yaml.load_all(Path(path).read_text(), Loader=_LOADER) if d]
        errors = validate_docs(docs, validators, args.require_all)
        checked = sum((d.get("apiVersion"), d.get("kind")) in validators for d in docs)
        for line in errors:
            print(f"ERROR {path}: {line}")
        print(f"{'FAIL' if errors else 'OK  '} {path}: {checked} custom resource(s) checked")
        failed += bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
