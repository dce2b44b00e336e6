"""/docs works without internet access (its assets come from the gateway) and the OpenAPI
document declares how callers authenticate, with operation ids a generated client can use.
The page itself is rendered offline in Chromium by test_dashboard.py."""

from __future__ import annotations

import re

from tests.conftest import Gateway

ASSET = re.compile(r"""(?:src|href)\s*=\s*['"]([^'"]+)['"]|url:\s*['"]([^'"]+)['"]""")


async def test_docs_pages_load_their_assets_from_the_gateway(gateway: Gateway) -> None:
    for page in ("/docs", "/redoc"):
        r = await gateway.http.get(page)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        urls = [a or b for a, b in ASSET.findall(r.text)]
        assert urls, r.text
        for url in urls:
            assert url.startswith("/"), f"{page} loads {url} from elsewhere"
            asset = await gateway.http.get(url)
            assert asset.status_code == 200 and asset.content, url
    js = await gateway.http.get("/docs/assets/swagger-ui-bundle.js")
    assert len(js.content) > 500_000 and "javascript" in js.headers["content-type"]


async def test_openapi_declares_security_schemes_and_readable_operation_ids(
    gateway: Gateway,
) -> None:
    doc = (await gateway.http.get("/openapi.json")).json()
    schemes = doc["components"]["securitySchemes"]
    assert schemes["apiKey"] == {**schemes["apiKey"], "type": "http", "scheme": "bearer"}
    assert schemes["apiKeyHeader"] == {**schemes["apiKeyHeader"], "type": "apiKey",
                                       "in": "header", "name": "X-API-Key"}
    assert schemes["adminToken"] == {**schemes["adminToken"], "type": "http", "scheme": "bearer"}

    ops = {(method, path): op for path, item in doc["paths"].items()
           for method, op in item.items()}
    ids = {key: op["operationId"] for key, op in ops.items()}
    assert ids[("post", "/api/v1/tasks")] == "submit_task"
    assert ids[("get", "/api/v1/tasks/{task_id}")] == "get_task"
    assert ids[("post", "/api/v1/tasks/{task_id}/cancel")] == "cancel_task"
    assert ids[("post", "/api/v1/tasks/{task_id}/complete")] == "complete_task"
    assert ids[("post", "/admin/v1/endpoints")] == "create_endpoint"
    assert ids[("post", "/admin/v1/api-keys")] == "create_api_key"
    assert len(set(ids.values())) == len(ids)
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", i) for i in ids.values()), ids

    api_key: list[dict[str, list[str]]] = [{"apiKey": []}, {"apiKeyHeader": []}]
    for (method, path), op in ops.items():
        expected = (api_key if path.startswith(("/api/", "/proxy/")) else
                    [{"adminToken": []}] if path.startswith("/admin/") else None)
        assert op.get("security") == expected, (method, path)
        # The key is the security scheme's business, not an argument of every call.
        assert not any(p["name"].lower() == "authorization" for p in op.get("parameters", []))
    proxy = [op for (_, path), op in ops.items() if path.startswith("/proxy/")]
    assert len(proxy) == 7 and all(op["security"] == api_key for op in proxy)
    for path in ("/healthz", "/readyz", "/metrics", "/auth/check"):
        assert "security" not in next(iter(doc["paths"][path].values()))
