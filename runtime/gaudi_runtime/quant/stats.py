"""Measurement files in Intel Neural Compressor's layout, so INC and our float8 path read the same files.

For a `dump_stats_path` prefix P, one rank of an unsharded model writes
`P_hooks_maxabs.json` (plus `.npz` and `_mod_list.json`); rank r of N writes
`P_hooks_maxabs_{r}_{N}.json`. The JSON is

    {"GlobalRank": r|null, "LocalRank": r|null, "Mode": "DynamicRange",
     "Nodes": {"<layer name>": {"inputs": [[[maxabs]]], "outputs": [[maxabs]], "params": {"weight": [[maxabs]]}}}}

with per-tensor max-abs values (the maxabs observer). Readers accept any
nesting of the numbers, since INC versions differ in it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MODE = "DynamicRange"


@dataclass
class NodeStats:
    inputs: list[float] = field(default_factory=list)  # max |x| of each input
    output: float | None = None
    weight: float | None = None

    def update(self, inputs: list[float], output: float | None, weight: float | None) -> None:
        if not self.inputs:
            self.inputs = list(inputs)
        else:
            self.inputs = [max(a, b) for a, b in zip(self.inputs, inputs, strict=True)]
        if output is not None:
            self.output = output if self.output is None else max(self.output, output)
        if weight is not None:
            self.weight = weight if self.weight is None else max(self.weight, weight)


def stats_base(prefix: str | Path, rank: int, world_size: int) -> str:
    suffix = f"_hooks_maxabs_{rank}_{world_size}" if world_size > 1 else "_hooks_maxabs"
    return f"{prefix}{suffix}"


def stats_file(prefix: str | Path, rank: int, world_size: int) -> Path:
    """The JSON file of one rank (INC also writes `_0_1` for a single rank run under a launcher: accepted)."""
    path = Path(stats_base(prefix, rank, world_size) + ".json")
    if world_size == 1 and not path.is_file():
        alt = Path(f"{prefix}_hooks_maxabs_0_1.json")
        if alt.is_file():
            return alt
    return path


def _node_json(s: NodeStats) -> dict:
    node: dict = {"inputs": [[[v]] for v in s.inputs]}
    if s.output is not None:
        node["outputs"] = [[s.output]]
    if s.weight is not None:
        node["params"] = {"weight": [[s.weight]]}
    return node


def write_stats(prefix: str | Path, nodes: dict[str, NodeStats], rank: int = 0, world_size: int = 1) -> Path:
    """Write the JSON, NPZ and module-list files of one rank; return the JSON path."""
    base = stats_base(prefix, rank, world_size)
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    ranked = rank if world_size > 1 else None
    doc = {"GlobalRank": ranked, "LocalRank": ranked, "Mode": MODE,
           "Nodes": {name: _node_json(s) for name, s in sorted(nodes.items())}}
    Path(base + ".json").write_text(json.dumps(doc, indent=1))
    # INC's .npz holds the same dictionary pickled as arr_0, numbers as numpy arrays.
    as_np = {**doc, "Nodes": {name: {k: (np.array(v, dtype=np.float32) if k != "params" else
                                         {p: np.array(w, dtype=np.float32) for p, w in v.items()})
                                     for k, v in node.items()} for name, node in doc["Nodes"].items()}}
    np.savez(base + ".npz", as_np)
    Path(base + "_mod_list.json").write_text(json.dumps(list(doc["Nodes"])))
    return Path(base + ".json")


def _maxabs(value) -> float:
    flat = np.abs(np.asarray(value, dtype=np.float64)).reshape(-1)
    if flat.size == 0:
        raise ValueError("empty statistic")
    return float(flat.max())


def read_stats(prefix: str | Path, rank: int = 0, world_size: int = 1) -> dict[str, NodeStats]:
    """The per-layer statistics of one rank; a missing file or a malformed node raises ValueError naming it."""
    path = stats_file(prefix, rank, world_size)
    if not path.is_file():
        raise ValueError(f"measurement file {path} does not exist")
    try:
        doc = json.loads(path.read_text())
        nodes = doc["Nodes"]
        out = {}
        for name, node in nodes.items():
            inputs = node.get("inputs", node.get("input", []))
            output = node.get("outputs", node.get("output"))
            weight = (node.get("params") or {}).get("weight")
            out[name] = NodeStats(inputs=[_maxabs(i) for i in inputs],
                                  output=None if output is None else _maxabs(output),
                                  weight=None if weight is None else _maxabs(weight))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"measurement file {path} is not in INC's layout: {e}") from None
    return out
