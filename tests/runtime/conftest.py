"""Fixtures for runtime tests: the tiny model, and HTTP servers over a fake engine.

`server_url` is what the client tests use. It serves the fake engine by default;
to run the same tests against another server, override the fixture (or
parametrize it), or set GAUDI_SERVE_TEST_URL (and GAUDI_SERVE_TEST_API_KEY) to
the base URL of a running server.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from gaudi_runtime.config import resolve
from gaudi_runtime.router.server import build_app, get_metrics
from gaudi_runtime.router.tokenizer import RouterTokenizer
from tests.runtime.fake_engine import FakeEngine, ServerThread
from tests.runtime.vllm_events import FIXTURE as VLLM_FIXTURE
from tests.runtime.vllm_events import VllmDecoder, VllmInstall

SERVER_ENV = {
    "MAX_INPUT_TOKENS": "64",
    "MAX_TOTAL_TOKENS": "128",
    "MAX_BEST_OF": "2",
    "MAX_STOP_SEQUENCES": "4",
    "MAX_TOP_N_TOKENS": "5",
    "MAX_CLIENT_BATCH_SIZE": "4",
    "MODEL_NAME": "tiny-llama",
    "DEVICE": "cpu",
    "DTYPE": "float32",
}


_VLLM: dict[str, VllmInstall] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Install vLLM's KV-event classes (once per machine) in the background as soon as a selected
    test needs them, so the download overlaps the tests before it."""
    if session.config.option.collectonly or _VLLM:
        return
    if any(VLLM_FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        _VLLM["install"] = VllmInstall().start()


@pytest.fixture(scope="session")
def vllm_classes() -> str:
    """A PYTHONPATH entry under which `vllm.distributed.kv_events` imports (hack/vllm-kv-events.sh).
    Without it the test fails, never skips: it is how the events are checked against vLLM."""
    install = _VLLM.setdefault("install", VllmInstall().start())
    try:
        return install.wait()
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def vllm_decoder(vllm_classes):
    """vLLM's KVEventBatch decoder, in a process of its own (tests/runtime/vllm_decode.py)."""
    decoder = VllmDecoder(vllm_classes)
    yield decoder
    decoder.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from gaudi_runtime.tools.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("http_tiny") / "llama", "llama"))


@pytest.fixture(scope="session")
def router_tokenizer(tiny_model_dir) -> RouterTokenizer:
    return RouterTokenizer.load(tiny_model_dir, resolve(None, {"MODEL_ID": tiny_model_dir}).model)


@dataclass
class Served:
    url: str
    engine: FakeEngine
    config: object
    app: object
    thread: ServerThread

    @property
    def metrics(self):
        return get_metrics(self.app)


def _serve(model_dir: str, tokenizer: RouterTokenizer | None = None, **env: str) -> Served:
    config = resolve(None, {"MODEL_ID": model_dir, **SERVER_ENV, **env})
    tok = tokenizer if tokenizer is not None and not config.model.skip_tokenizer_in_tgi else \
        RouterTokenizer.load(model_dir, config.model)
    engine = FakeEngine(tok)
    app = build_app(config, engine, tok)
    thread = ServerThread(app).start()
    return Served(thread.url, engine, config, app, thread)


@pytest.fixture
def make_server(tiny_model_dir, router_tokenizer):
    """Factory: make_server(API_KEY="k", ...) -> Served (env-style settings override SERVER_ENV)."""
    made: list[Served] = []

    def make(**env: str) -> Served:
        s = _serve(tiny_model_dir, router_tokenizer, **env)
        made.append(s)
        return s

    yield make
    for s in made:
        s.thread.stop()


@pytest.fixture(scope="session")
def fake_server(tiny_model_dir, router_tokenizer):
    s = _serve(tiny_model_dir, router_tokenizer)
    yield s
    s.thread.stop()


@pytest.fixture(scope="session")
def real_server(tiny_model_dir, tmp_path_factory):
    """The real runtime (launcher, shard, router) on the tiny model."""
    from tests.runtime.launched import launch

    srv = launch(tiny_model_dir, tmp_path_factory.mktemp("real"), "--dtype", "float32",
                 "--max-input-tokens", "64", "--max-total-tokens", "128", "--max-batch-size", "8",
                 "--model-name", "tiny-llama", env={"PAD_SEQUENCE_TO_MULTIPLE_OF": "16"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session", params=["fake-engine", "real-engine"])
def server_url(request) -> str:
    """Base URL of the server the client tests talk to: the HTTP layer over a fake engine,
    then the whole real runtime (or, for both, GAUDI_SERVE_TEST_URL)."""
    url = os.environ.get("GAUDI_SERVE_TEST_URL")
    if url:
        return url.rstrip("/")
    if request.param == "real-engine":
        return request.getfixturevalue("real_server").url
    return request.getfixturevalue("fake_server").url


@pytest.fixture(scope="session")
def server_api_key() -> str | None:
    """Bearer token for `server_url` (None: the server needs none)."""
    return os.environ.get("GAUDI_SERVE_TEST_API_KEY") or None
