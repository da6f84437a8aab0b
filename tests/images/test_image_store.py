"""The tests' image storage does not grow from run to run: a build stopped mid-step (a session that
ended, or was killed, before the images were needed) keeps a working container holding the layer it
was writing, which `podman image prune` never removes; the next build removes it first."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.e2e.harness import wait_for
from tests.images.engine import Images


def external_containers(images: Images) -> set[str]:
    return set(images.podman("ps", "--all", "--external", "--quiet").stdout.split())


def test_a_stopped_build_leaves_nothing_for_the_next_one(images: Images, tmp_path: Path) -> None:
    before = external_containers(images)
    (tmp_path / "Containerfile").write_text(
        f"FROM {images.base}\nRUN head -c 50000000 /dev/zero > /layer && sleep 300\n")
    build = subprocess.Popen(["podman", "build", "--layers", "--isolation", "chroot", "-t",
                              "localhost/gaudi-serve-test/stopped:latest", str(tmp_path)],
                             env=images.podman.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        wait_for(lambda: external_containers(images) - before, 120, "the build's working container")
    finally:
        build.terminate()
        build.wait(60)
    assert external_containers(images) - before, "the stopped build left no working container to clean up"

    images.podman.remove_leftovers()

    assert not external_containers(images), "a stopped build's working container survived the cleanup"
    assert images.podman("image", "exists", images.runtime, check=False).returncode == 0
