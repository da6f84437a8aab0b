"""Operator-wide tuning, read once before Kopf starts and handed to the handlers in Kopf's memo.

One immutable object instead of module globals read at import time: the CLI can
override a value without touching the process environment, and a test or an
embedding program passes its own to `kopf.run(memo=kopf.Memo(config=...))`.
(Named "config", not "settings", because Kopf's handlers already receive
Kopf's own `settings`.)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["OperatorConfig"]


def _env(name: str) -> dict[str, str]:
    return {"env": name}


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = field(default=15.0, metadata=_env("GAUDI_OPERATOR_RESYNC_SECONDS"))
    cluster_domain: str = field(default="cluster.local", metadata=_env("GAUDI_OPERATOR_CLUSTER_DOMAIN"))
    warmup_concurrency: int = field(default=8, metadata=_env("GAUDI_OPERATOR_WARMUP_CONCURRENCY"))
    warmup_timeout: float = field(default=2.0, metadata=_env("GAUDI_OPERATOR_WARMUP_TIMEOUT"))
    watch_timeout: int = field(default=300, metadata=_env("GAUDI_OPERATOR_WATCH_TIMEOUT"))
    # Where the operator's own pods run and their labels (`k=v,k=v`): a NetworkPolicy admits
    # them for the warmup poll. The chart sets both (the namespace through the downward API).
    namespace: str = field(default="", metadata=_env("GAUDI_OPERATOR_NAMESPACE"))
    pod_labels: str = field(default="", metadata=_env("GAUDI_OPERATOR_POD_LABELS"))
    # The endpoint picker the operator runs for a spec.gateway that names none: its image, extra
    # arguments (whitespace-separated) and the ClusterRole its RoleBinding grants (the chart's).
    picker_image: str = field(default="", metadata=_env("GAUDI_OPERATOR_EPP_IMAGE"))
    picker_args: str = field(default="", metadata=_env("GAUDI_OPERATOR_EPP_ARGS"))
    picker_cluster_role: str = field(default="", metadata=_env("GAUDI_OPERATOR_EPP_CLUSTER_ROLE"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """Defaults, overridden by the GAUDI_OPERATOR_* variables that are set (the chart sets them)."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is not None:
                try:
                    values[f.name] = type(f.default)(raw)
                except ValueError:
                    raise ValueError(f"{f.metadata['env']}={raw!r} is not a {type(f.default).__name__}") from None
        return cls(**values)
