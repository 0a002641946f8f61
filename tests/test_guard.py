"""The ASGI guard on a real FastAPI app (no engine): metrics are labelled by route template, so
clients cannot mint label values; the API key guards every route but /health and /metrics."""

import pytest

from trtserve.server.app import Guard
from trtserve.server.config import ServerConfig
from trtserve.server.http import key_matches
from trtserve.server.metrics import Metrics


def app_with_guard(cfg: ServerConfig, metrics: Metrics):
    require = pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e .[serve]")
    app = require.FastAPI()
    app.add_middleware(Guard, cfg=cfg, metrics=metrics, routes=lambda: app.routes)

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def test_metrics_are_labelled_by_route_template_not_by_raw_path():
    from starlette.testclient import TestClient

    metrics = Metrics()
    client = TestClient(app_with_guard(ServerConfig(engine_dir="unused"), metrics))
    assert client.get("/v1/models").status_code == 200
    for i in range(200):
        assert client.get(f"/probe/{i}?x={i}").status_code == 404
    assert client.post("/v1/models").status_code == 405
    text = metrics.render()[0].decode()
    assert 'route="/v1/models",status="200"' in text and 'route="/v1/models",status="405"' in text
    assert 'route="unmatched",status="404"' in text and "/probe/" not in text
    routes = {line.split('route="')[1].split('"')[0] for line in text.splitlines() if 'route="' in line}
    assert routes == {"/v1/models", "unmatched"}


def test_the_api_key_guards_all_but_health_and_metrics():
    from starlette.testclient import TestClient

    client = TestClient(app_with_guard(ServerConfig(engine_dir="unused", api_key="k"), Metrics()))
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer \u00e9".encode("latin-1")}).status_code == 401
    assert client.get("/health").status_code == 200
    assert key_matches(ServerConfig(engine_dir="unused"), "") and not key_matches(
        ServerConfig(engine_dir="unused", api_key="k"), "Bearer x")
