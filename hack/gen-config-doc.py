#!/usr/bin/env python3
"""Generate docs/configuration.md from the sources of truth, so the reference cannot drift:

* every InferenceService field, its type, default, constraints and description, and the CEL
  validation rules, from the CRD's openAPIV3Schema (crds/inferenceservices.gaudiserve.io.yaml);
* every runtime flag and environment variable from gaudi_runtime.config (FLAGS, ENV_ONLY);
* every operator flag (gaudi_operator.cli) and GAUDI_OPERATOR_* variable (gaudi_operator.config).

    python hack/gen-config-doc.py           # print
    python hack/gen-config-doc.py --write   # rewrite docs/configuration.md
    python hack/gen-config-doc.py --check   # exit 1 if docs/configuration.md is stale

tests/unit/test_examples.py checks that the committed file equals this output.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "crds" / "inferenceservices.gaudiserve.io.yaml"
DOC_PATH = ROOT / "docs" / "configuration.md"
for sub in ("runtime", "operator"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))


def _cell(value: Any) -> str:
    text = " ".join(str(value).split())
    return text.replace("|", "\\|")


def _code(value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        value = str(value).lower()
    elif isinstance(value, (dict, list)):
        value = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return f"`{_cell(value)}`"


def _type(schema: dict[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "int or string"
    t = schema.get("type", "any")
    if t == "array":
        items = schema.get("items") or {}
        return f"[]{_type(items) if items.get('type') != 'object' else 'object'}"
    if t == "object" and "additionalProperties" in schema and "properties" not in schema:
        return f"map[string]{_type(schema['additionalProperties'])}"
    if schema.get("enum"):
        return f"{t} (enum)"
    return t


def _constraints(schema: dict[str, Any]) -> str:
    parts = []
    if schema.get("enum"):
        parts.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
    for key, word in (("minimum", "≥"), ("maximum", "≤"), ("minLength", "length ≥")):
        if key in schema:
            parts.append(f"{word} {schema[key]}")
    if schema.get("required") and schema.get("type") == "object":
        parts.append("requires " + ", ".join(f"`{r}`" for r in schema["required"]))
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        parts.append("free-form")
    return "; ".join(parts)


def _fields(schema: dict[str, Any], path: str, rows: list[list[str]], rules: list[tuple[str, str]]) -> None:
    for rule in schema.get("x-kubernetes-validations") or []:
        rules.append((path, rule.get("message") or rule["rule"]))
    props = schema.get("properties") or {}
    items = schema.get("items") if schema.get("type") == "array" else None
    if items and items.get("properties"):
        props, path = items["properties"], f"{path}[]"
    for name, sub in props.items():
        sub_path = f"{path}.{name}"
        rows.append([f"`{sub_path}`", _type(sub), _code(sub.get("default")), _constraints(sub),
                     _cell(sub.get("description", ""))])
        _fields(sub, sub_path, rows, rules)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def spec_section() -> list[str]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    out = [f"## {kind} ({group}/{version['name']})", "",
           _cell(schema.get("description", "")), ""]
    rows: list[list[str]] = []
    rules: list[tuple[str, str]] = []
    _fields(schema["properties"]["spec"], "spec", rows, rules)
    _fields_required = schema["properties"]["spec"].get("required") or []
    out += ["### Spec", "", f"Required: {', '.join(f'`spec.{r}`' for r in _fields_required)}.", ""]
    out += _table(["field", "type", "default", "constraints", "description"], rows)
    out += ["", "### Validation rules (CEL, enforced by the API server)", ""]
    out += _table(["on", "message"], [[f"`{p}`", _cell(m)] for p, m in rules])
    status_rows: list[list[str]] = []
    _fields(schema["properties"]["status"], "status", status_rows, [])
    out += ["", "### Status (written by the operator)", ""]
    out += _table(["field", "type", "default", "constraints", "description"], status_rows)
    out += ["", "### `kubectl get gisvc` columns", ""]
    out += _table(["column", "type", "JSONPath", "description"],
                  [[c["name"], c["type"], f"`{c['jsonPath']}`", _cell(c.get("description", ""))]
                   for c in version.get("additionalPrinterColumns") or []])
    sub = version.get("subresources") or {}
    scale = sub.get("scale") or {}
    out += ["", f"Subresources: {', '.join(f'`{k}`' for k in sub)}"
            + (f" (scale: replicas `{scale['specReplicasPath']}`, selector `{scale['labelSelectorPath']}`)."
               if scale else ".")]
    return out


def runtime_section() -> list[str]:
    from gaudi_runtime import config

    rows = []
    for flag, env, typ, default, help_ in config.FLAGS:
        env = env or flag.lstrip("-").replace("-", "_").upper()
        rows.append([f"`{flag}`", f"`{env}`", typ.__name__.lstrip("_"),
                     "none" if default is None else _code(default), _cell(help_)])
    env_rows = [[f"`{env}`", typ.__name__.lstrip("_"), _code(default), _cell(help_)]
                for env, typ, default, help_ in config.ENV_ONLY]
    out = ["## Runtime (`gaudi-serve launch`)", "",
           "Flags carry TGI's names; each also reads the environment variable shown, the flag winning. "
           "A default of \"none\" means unset, or derived from other settings as the description says. "
           "Kubernetes sets `HOSTNAME` to the pod name, so the operator always passes `--hostname`.", ""]
    out += _table(["flag", "env", "type", "default", "description"], rows)
    out += ["", "### Environment-only settings", ""]
    out += _table(["env", "type", "default", "description"], env_rows)
    return out


def operator_section() -> list[str]:
    from gaudi_operator import cli
    from gaudi_operator.config import OperatorConfig

    # The parser reads a few defaults from the environment: document the built-in ones.
    saved = {k: os.environ.pop(k) for k in ("LOG_LEVEL", "LOG_FORMAT", "LIVENESS_ENDPOINT") if k in os.environ}
    try:
        parser = cli.build_parser()
    finally:
        os.environ.update(saved)
    rows = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        default = action.default
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            default = None
        help_ = re.sub(r"\s*\[env: [^\]]*\]", "", action.help or "")
        env = re.search(r"\[env: ([A-Z_]+)", action.help or "")
        rows.append([", ".join(f"`{o}`" for o in action.option_strings), f"`{env.group(1)}`" if env else "",
                     "" if default is None or default is False else _code(default), _cell(help_)])
    env_rows = [[f"`{f.metadata['env']}`", _code(f"{f.default:g}" if isinstance(f.default, float) else f.default)]
                for f in dataclasses.fields(OperatorConfig)]
    out = ["## Operator (`gaudi-operator`)", ""]
    out += _table(["flag", "env", "default", "description"], rows)
    out += ["", "Tuning variables read by the operator at start:", ""]
    out += _table(["env", "default"], env_rows)
    return out


def generate() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by hack/gen-config-doc.py from crds/inferenceservices.gaudiserve.io.yaml,",
        "     gaudi_runtime.config and gaudi_operator; do not edit by hand:",
        "     python hack/gen-config-doc.py --write -->",
        "",
        "Every `InferenceService` field, every runtime flag and environment variable, and every",
        "operator option. The operator passes `spec.serving` as the runtime flags of the same name and",
        "`spec.batching` as the environment variables named in each description.",
        "",
        *spec_section(),
        "",
        *runtime_section(),
        "",
        *operator_section(),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help=f"write {DOC_PATH.relative_to(ROOT)}")
    g.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    args = p.parse_args(argv)
    text = generate()
    if args.write:
        DOC_PATH.write_text(text)
    elif args.check:
        if not DOC_PATH.is_file() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH.relative_to(ROOT)} is stale: run python hack/gen-config-doc.py --write",
                  file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
