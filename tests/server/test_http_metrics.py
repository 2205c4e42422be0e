"""radixserve:http_responses_total leaves out the server's own warm-up (the header is believed
only before the server is ready), and counts everything else by route and status."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from radixserve.server.http_metrics import HTTPMetricsMiddleware
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native_api import WARM_UP_HEADER, is_warm_up


def test_the_warm_up_is_not_counted_but_a_header_after_ready_is() -> None:
    router = APIRouter()

    @router.post("/generate")
    async def generate() -> dict:
        return {}

    ready = [False]
    metrics = ServerMetrics("m")
    app = FastAPI()
    app.include_router(router)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics, routes=router.routes,
                       is_internal=lambda scope: is_warm_up(scope, lambda: ready[0]))
    client = TestClient(app)

    def count() -> float:
        return metrics.registry.get_sample_value(
            "radixserve:http_responses_total",
            {"method": "POST", "route": "/generate", "status": "200"}) or 0.0

    assert client.post("/generate", headers={WARM_UP_HEADER: "1"}).status_code == 200
    assert count() == 0
    client.post("/generate")
    assert count() == 1
    ready[0] = True
    client.post("/generate", headers={WARM_UP_HEADER: "1"})
    assert count() == 2
