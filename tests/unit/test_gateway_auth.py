"""The gateway's keys (`gateway/app.py`): which key a path wants and how a presented one is checked, as SGLang's
own servers decide (`sglang.srt.utils.auth.decide_request_auth` is the oracle for the paths both have)."""

from __future__ import annotations

import pytest

from sgl_multilora.gateway.app import presents, required_key

API, ADMIN = "api-key", "admin-key"


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/ready", "/metrics"])
def test_probes_are_open_whatever_keys_are_set(path):
    assert required_key(path, API, ADMIN) is None


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/models", "/cluster/stats",
                                  "/abort_request"])
@pytest.mark.parametrize("api, admin", [(None, None), (API, None), (None, ADMIN), (API, ADMIN)])
def test_serving_paths_want_the_api_key_as_a_worker_does(path, api, admin):
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    want = required_key(path, api, admin)
    assert want == api
    for header in (None, "Bearer wrong", f"Bearer {API}", f"Bearer {ADMIN}"):
        ours = want is None or presents(header, want)
        sglang = decide_request_auth(method="POST", path=path, authorization_header=header, api_key=api,
                                     admin_api_key=admin, auth_level=AuthLevel.NORMAL).allowed
        assert ours == sglang, (path, api, admin, header)


@pytest.mark.parametrize("api, admin, want", [(None, None, None), (API, None, API), (None, ADMIN, ADMIN),
                                              (API, ADMIN, ADMIN)])
def test_moving_requests_wants_the_admin_key_when_there_is_one(api, admin, want):
    assert required_key("/cluster/migrate", api, admin) == want


@pytest.mark.parametrize("header, ok", [(f"Bearer {API}", True), (f"bearer {API}", True), (API, False),
                                        (f"Bearer {API}x", False), (f"Basic {API}", False), (None, False),
                                        ("", False), ("Bearer ", False)])
def test_presents_takes_a_bearer_token_only(header, ok):
    assert presents(header, API) is ok
