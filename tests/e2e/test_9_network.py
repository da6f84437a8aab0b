"""Network hygiene: no process of the suite listened on, or talked to, an address outside
127.0.0.0/8 (sampled all session long by tests/e2e/netwatch.py; checked again at teardown)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.netwatch import WATCH, listening, violations

pytestmark = pytest.mark.simulated


def test_every_socket_stayed_inside_127_0_0_0_8(cluster: Cluster) -> None:
    assert cluster.cp is not None
    assert WATCH.pgids >= {c.proc.pid for c in cluster.cp.components}
    assert WATCH.samples > 0
    # The sampler does see our sockets: the API server's, on loopback.
    api = next(c for c in cluster.cp.components if c.name == "kube-apiserver")
    assert ("127.0.0.1", cluster.cp.api_port) in listening({api.proc.pid})
    now = violations(set(WATCH.pgids))
    assert not WATCH.found and not now, sorted(WATCH.found | set(now))
