"""The runtime image (Dockerfile.runtime, cpu variant), run the way the operator's pod runs it:
the user, command, arguments, environment, capabilities and /data volume that render.py puts in
the pod spec, and on top a read-only root filesystem with a writable /tmp. It loads the tiny
model mounted at /data, answers the rendered probes and /generate, and stops on SIGTERM. What
render.py assumes of the image (user, port, entry point, /data, HF_HOME) is read from the built
image's configuration, not from a constant.

What cannot hold outside a cluster is replaced, as in tests/e2e/test_6_real_runtime.py: the model
(the tiny one mounted at the cache path rather than a hub id downloaded there) and, with host
networking, the address and port (127.0.0.1 and a free port rather than 0.0.0.0:8080).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gaudi_operator.render import pod_template
from gaudi_operator.spec import parse_spec
from tests.e2e.harness import http_json, wait_for
from tests.images.engine import Images, image_env, pod_flags
from tests.runtime.launched import free_port

BODY = {
    "metadata": {"name": "tiny", "namespace": "ml", "uid": "u"},
    "spec": {"model": {"id": "gaudi-serve/tiny-llama"}, "shards": 1,
             "serving": {"maxInputTokens": 32, "maxTotalTokens": 64, "maxBatchSize": 2},  # a few warmup shapes
             "batching": {"padSequenceToMultipleOf": 16, "batchBucketSize": 2, "prefillBatchBucketSize": 2,
                          "hpuGraphs": False}},
}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@pytest.fixture(scope="module")
def pod() -> dict[str, Any]:
    return pod_template(BODY, parse_spec(BODY["spec"]))["spec"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gaudi_runtime.tools.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama", "llama")
    model.chmod(0o755)  # readable by the image's user, as a volume the pod's fsGroup owns
    for f in model.iterdir():
        f.chmod(0o644)
    return model


def data_dir(container: dict[str, Any]) -> str:
    return next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "model-cache")


def with_values(args: list[str], values: dict[str, str]) -> list[str]:
    out = list(args)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def test_the_image_is_what_the_operator_renders_for_it(images: Images, pod: dict[str, Any]) -> None:
    config = images.config(images.runtime)
    c = pod["containers"][0]
    assert config["User"] == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    assert config["Entrypoint"] == c["command"]
    assert set(config["ExposedPorts"]) == {f"{p['containerPort']}/{p['protocol'].lower()}" for p in c["ports"]}
    env, rendered = image_env(config), {e["name"]: e["value"] for e in c["env"] if "value" in e}
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE"):
        assert env[name] == rendered[name], name
    assert env["HF_HOME"] == data_dir(c) == config["WorkingDir"]
    # The image's user owns /data, so the cache volume mounted there is writable without fsGroup.
    out = images.podman("run", "--rm", "--network", "none", *images.podman.run_flags(images.runtime),
                        "--entrypoint", "stat", images.runtime, "--format", "%u:%g", data_dir(c))
    assert out.stdout.strip() == config["User"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "gaudi-serve-runtime"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"].startswith("https://")


def test_the_image_loads_its_cpu_kernels_prebuilt_and_has_no_compiler(images: Images) -> None:
    """Each C kernel loads from the libraries built with the image (for the best level this CPU runs): a shard
    needs no compiler at start, and the image has none."""
    flags = ["--rm", "--network", "none", "--read-only", *images.podman.run_flags(images.runtime)]
    out = images.podman("run", *flags, "--entrypoint", "gaudi-serve", images.runtime, "build-kernels", "--check",
                        check=False)
    assert out.returncode == 0, out.stderr
    libs = out.stdout.split()
    assert libs and all(lib.startswith("/opt/gaudi-serve/kernels/") for lib in libs), out.stdout
    found = images.podman("run", *flags, "--entrypoint", "sh", images.runtime, "-c", "command -v cc gcc clang",
                          check=False)
    assert found.stdout.strip() == "", f"a compiler in the runtime image: {found.stdout}"


def test_the_image_serves_the_tiny_model_as_the_pod_runs_it(images: Images, pod: dict[str, Any],
                                                            tiny_model: Path) -> None:
    from text_generation import Client

    c = pod["containers"][0]
    port = free_port()
    args = with_values(c["args"], {"--model-id": data_dir(c), "--hostname": "127.0.0.1", "--port": str(port)})
    flags = pod_flags(pod, c, {data_dir(c): f"{tiny_model}:ro"}) + ["--read-only"]
    container = images.podman.start(images.runtime, args, flags)
    url = f"http://127.0.0.1:{port}"
    try:
        def answers(path: str) -> bool:
            assert container.running(), f"the runtime exited:\n{container.logs()}"
            try:
                return http_json("GET", url + path, timeout=5)[0] == 200
            except OSError:
                return False
        for probe in PROBES:  # in the kubelet's order, on the port the probes name
            get = c[probe]["httpGet"]
            assert get["port"] == c["ports"][0]["name"]
            wait_for(lambda p=get["path"]: answers(p), 240, f"the {probe} ({get['path']}) to pass")

        r = Client(url, timeout=60).generate("The cards are warm and", max_new_tokens=4)
        assert isinstance(r.generated_text, str) and r.details.generated_tokens == 4
        user = (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"])
        assert container.users() == {user}, "every process runs as the pod's user"
        denied = images.podman("exec", container.name, "touch", "/opt/written", check=False)
        assert "Read-only file system" in denied.stderr, denied
        assert container.stop() == 0, container.logs()  # SIGTERM: every process stops cleanly
    finally:
        container.remove()
