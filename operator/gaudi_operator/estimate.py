"""What a pod of this spec will warm up, read from the runtime's own bucket code (pure).

The operator does not model warmup: it builds the runtime's configuration from the command line and
environment it renders into the pod, exactly as `gaudi-serve launch` on a Gaudi card would resolve
them, and asks `gaudi_runtime.buckets.warmup_plan` (the function the shards warm up from) for the
shapes. `gaudi_runtime.config` and `gaudi_runtime.buckets` import neither torch nor anything of the
runtime's heavy dependencies, so the operator image carries them (Dockerfile.operator installs the
package without its extras).

Nothing here sizes a probe: the probes follow the pod's progress (render.probes). The figure is shown
while a pod loads, before the pod reports its own total.
"""

from __future__ import annotations

import argparse
from typing import Any

from gaudi_runtime import buckets
from gaudi_runtime.config import Config, ConfigError, add_arguments, resolve

from .render import runtime_args, runtime_env
from .spec import InferenceServiceSpec

# The device a Gaudi pod's `--device auto` resolves to.
POD_DEVICE = "hpu"

__all__ = ["expected_warmup_shapes", "pod_runtime_config"]


def pod_runtime_config(args: list[str], env: list[dict[str, Any]], shards: int) -> Config:
    """The runtime's configuration for the container `args` (after `launch`) and `env` on a Gaudi node.

    Variables taken from Secrets or fields (valueFrom) are unknown here and left out; none of them sets
    a bucket. Raises ConfigError where the runtime would refuse to start."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    parsed, _ = parser.parse_known_args(args[1:] if args[:1] == ["launch"] else args)
    environ = {e["name"]: str(e["value"]) for e in env if "value" in e and "name" in e}
    if parsed.device is None and "DEVICE" not in environ:
        parsed.device = POD_DEVICE
    return resolve(parsed, environ, device_count=lambda _device: shards)


def expected_warmup_shapes(spec: InferenceServiceSpec) -> int | None:
    """How many shapes a pod of `spec` warms up on Gaudi (None: the runtime would refuse the settings)."""
    try:
        cfg = pod_runtime_config(runtime_args(spec), runtime_env(spec), spec.shards)
    except ConfigError:
        return None
    if not cfg.device.warmup_enabled:
        return 0
    return buckets.warmup_shape_count(cfg, cfg.device.decodes_flat)
