"""Write the JSON schema of one served version of a CustomResourceDefinition, as vendored beside this file.

    python tests/core/data/k8s/extract_crd_schema.py CRD.yaml VERSION SOURCE OUT.json

The output is ``{"apiVersion", "kind", "source", "schema"}``: ``schema`` is the CRD's ``openAPIV3Schema`` for
``VERSION`` with every ``description`` text removed (they are three quarters of the bytes and validate nothing);
everything else -- types, required fields, enums, patterns, ``x-kubernetes-*`` markers -- is kept as written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

#: Keys whose value is a map from names to schemas (a property called ``description`` is a schema to keep).
_NAMED_SCHEMAS = ("properties", "patternProperties", "definitions")


def without_descriptions(schema: Any) -> Any:
    if isinstance(schema, list):
        return [without_descriptions(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    kept = {}
    for key, value in schema.items():
        if key == "description" and isinstance(value, str):
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            kept[key] = {name: without_descriptions(sub) for name, sub in value.items()}
        else:
            kept[key] = without_descriptions(value)
    return kept


def main(crd_path: str, version: str, source: str, out: str) -> None:
    crd = next(doc for doc in yaml.safe_load_all(Path(crd_path).read_text()) if doc)
    served = {entry["name"]: entry for entry in crd["spec"]["versions"]}
    schema = served[version]["schema"]["openAPIV3Schema"]
    document = {"apiVersion": f"{crd['spec']['group']}/{version}", "kind": crd["spec"]["names"]["kind"],
                "source": source, "schema": without_descriptions(schema)}
    Path(out).write_text(json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
