"""What more than one test directory shares: the container images built from Dockerfile.operator
and Dockerfile.runtime (tests/images/engine.py), used by tests/images and by the operator-image
scenario of tests/e2e. Any test that takes the `images` fixture starts the build, in the
background, as soon as collection ends; if the build fails, those tests fail (never skip). And
`fake_hpu`, for the unit and runtime tests that drive the HPU backend."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.images.engine import BUILD_TIMEOUT_S, STORE, Build, Images

_BUILD: dict[str, Build] = {}


def _uses_images(item: pytest.Item) -> bool:
    return "images" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the image tests outside tests/e2e right before the e2e tests (which run last), so the
    background build has the rest of the session to finish; the wait for it is no test's timeout."""
    users = [item for item in items if _uses_images(item)]
    for item in users:
        item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S))
    moved = [item for item in users if "tests/e2e/" not in item.nodeid]
    if not moved:
        return
    ids = {id(item) for item in moved}
    rest = [item for item in items if id(item) not in ids]
    at = next((k for k, item in enumerate(rest) if "tests/e2e/" in item.nodeid), len(rest))
    items[:] = rest[:at] + moved + rest[at:]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the image build when a selected test needs it: first, so that it overlaps the e2e
    control plane's build (which runs in the foreground at this same point when not cached)."""
    if session.config.option.collectonly or _BUILD:
        return
    if any(_uses_images(item) for item in session.items):
        _BUILD["build"] = Build(STORE / "build.log")
        _BUILD["build"].start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if "build" in _BUILD:
        _BUILD["build"].stop()


def pytest_terminal_summary(terminalreporter) -> None:
    """The build's times, the images' sizes and the storage left on disk, for the CI log."""
    build = _BUILD.get("build")
    if build is None or build.result is None:
        return
    imgs = build.result
    sizes = ", ".join(f"{name} {imgs.size(ref) / 1e6:.0f} MB" for name, ref in
                      (("operator", imgs.operator), ("runtime", imgs.runtime)))
    times = ", ".join(f"{what} {s:.0f}s" for what, s in imgs.seconds.items())
    du = subprocess.run(["du", "-sh", str(STORE)], capture_output=True, text=True).stdout.split("\t")[0]
    terminalreporter.write_line(f"images: {sizes}; built in: {times}; {STORE}: {du}")


@pytest.fixture(scope="session")
def images() -> Iterator[Images]:
    """The operator and runtime images (cpu variant), built by hack/build-images.sh."""
    build = _BUILD.get("build")
    if build is None:  # a test that asked for the images without being collected as one
        build = _BUILD["build"] = Build(STORE / "build.log")
        build.start()
    try:
        built = build.wait()
    except RuntimeError as exc:
        pytest.fail(f"the images could not be built: {exc}")
    yield built
    built.podman.cleanup()


@pytest.fixture
def fake_hpu(monkeypatch):
    """The recording habana_frameworks fake (tests/fakes), importable for this test only; yields its record."""
    from tests.fake_modules import load_fake

    yield from load_fake(monkeypatch, "habana_frameworks", "habana_frameworks.torch")
