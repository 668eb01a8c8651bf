"""User code the gateway runs per request (an input model's validators) cannot stop it:
whatever it raises fails that request alone (issue 28, break 2, at the edge)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.helpers import GatewayProcess
from tests.support.faultapp import RAISED


@pytest.mark.timeout(120)
async def test_a_validator_raising_what_is_no_exception_fails_only_its_request(
    redis_url: str, tmp_path: Path
) -> None:
    # BREAK: a validator's SystemExit, KeyboardInterrupt or bare BaseException went past
    # every handler (each catches Exception) to the request's task, where asyncio re-raises
    # it out of the event loop: the gateway process ended.
    app = {"CONVEYOR_APP": "tests.support.faultapp:user_code"}
    with GatewayProcess(redis_url, tmp_path / "gateway.log", **app) as gw:
        assert gw.proc is not None
        async with httpx.AsyncClient(base_url=gw.base, timeout=30) as client:
            for kind in RAISED:
                if kind == "cancelled":
                    continue  # the server's own signal: not one a validator may give
                for path in ("/v1/touchy", "/v1/jobs/touchy"):
                    resp = await client.post(path, json={"kind": kind})
                    assert resp.status_code == 500, (kind, path, resp.text)
                    assert resp.json() == {"detail": "internal error"}
                    assert gw.proc.poll() is None, gw.log()
            # Still serving: a request it can refuse or enqueue is answered.
            health = await client.get("/healthz")
            assert health.status_code == 200, health.text
        assert "SystemExit raised on /v1/touchy; answered 500" in gw.log()
