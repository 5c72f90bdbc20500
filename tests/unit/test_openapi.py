"""`/openapi.json` documents every route's body and errors, and a wrong method is a 405 that
names the right ones (the generated-request run over the whole surface: test_openapi_fuzz.py)."""
from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from specserve.server.errors import APIError
from specserve.server.http import OPEN_PATHS, build_app
from specserve.server.responses import ErrorResponse
from tests.unit.test_http import FakeEngineClient

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
BODIES = {"/v1/chat/completions": ("ChatCompletionRequest", "messages"),
          "/v1/completions": ("CompletionRequest", "prompt"),
          "/generate": ("GenerateRequest", "text")}


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    r = TestClient(build_app(FakeEngineClient())).get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, ops in doc["paths"].items() for method, op in ops.items()]


@pytest.mark.parametrize("path", list(BODIES))
def test_post_routes_document_their_json_bodies(doc: dict[str, Any], path: str) -> None:
    name, field = BODIES[path]
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"] and body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
    assert field in doc["components"]["schemas"][name]["properties"]
    responses = doc["paths"][path]["post"]["responses"]
    assert {"200", "400", "401", "413", "500", "503"} <= set(responses)
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}


def test_every_error_is_one_documented_body(doc: dict[str, Any]) -> None:
    for path, method, op in operations(doc):
        errors = {code: r for code, r in op["responses"].items() if code != "200"}
        assert "500" in errors and ("401" in errors) == (path not in OPEN_PATHS), (method, path)
        assert "422" not in errors, (method, path)  # FastAPI's: errors.py answers 400 instead
        for code, r in errors.items():
            assert r["content"] == {"application/json": {"schema": ERROR_REF}}, (method, path, code)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert {"404"} <= set(doc["paths"]["/v1/chat/completions"]["post"]["responses"])
    assert {"409"} <= set(doc["paths"]["/generate"]["post"]["responses"])
    ids = [op["operationId"] for _, _, op in operations(doc)]
    assert len(ids) == len(set(ids))  # /flush_cache's GET and POST too


def test_error_bodies_are_error_responses() -> None:
    for err in (APIError(400, "bad", "n"), APIError(401, "who"), APIError(503, "down")):
        assert ErrorResponse.model_validate(err.body()).error.code == err.status


def test_wrong_method_is_405_naming_the_allowed_ones() -> None:
    http = TestClient(build_app(FakeEngineClient()))
    for method, path, allowed in [("PUT", "/v1/models", {"GET"}), ("GET", "/generate", {"POST"}),
                                  ("DELETE", "/flush_cache", {"GET", "POST"})]:
        r = http.request(method, path)
        assert r.status_code == 405 and r.json()["error"]["code"] == 405
        assert set(r.headers["allow"].replace(" ", "").split(",")) == allowed, r.headers


def test_with_an_api_key_the_document_declares_bearer_auth(doc: dict[str, Any]) -> None:
    assert "securitySchemes" not in doc["components"]
    http = TestClient(build_app(FakeEngineClient(api_key="k")))
    assert http.get("/openapi.json").status_code == 401
    keyed = http.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
    assert keyed["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, method, op in operations(keyed):
        assert ("security" in op) == (path not in OPEN_PATHS), (method, path)
