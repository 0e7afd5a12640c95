"""No run lost under the hosts users run the app with: uvicorn (ASGI) and gunicorn (WSGI), lenient and strict.

Every hostile return value of tests/hostile_values.py must come back as a JSON reply the platform can parse
(200 lenient; strict: the documented status, a 500 naming the path), never the host's plain-text
``Internal Server Error`` or a dropped connection.  Sent 160+ at once per host (the corpus four times over).
Skipped without uvicorn and gunicorn.
"""

from __future__ import annotations

import json
import textwrap
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterator, List, Tuple

import pytest

from conformance.harness.mock_proxy import MockProxy
from tests.hostile_values import HOSTILE
from tests.interop.hosts import (
    Reply,
    dispatch_request,
    gunicorn_command,
    http_call,
    started,
    subprocess_env,
    uvicorn_command,
)
from tests.test_no_run_lost import ESCAPED_SURROGATE

pytest.importorskip("uvicorn", reason="needs uvicorn (tests/interop/requirements-hosts.txt)")
pytest.importorskip("gunicorn", reason="needs gunicorn (tests/interop/requirements-hosts.txt)")

TOKEN = "agent-token-hostile-hosts-0123"
RUN_TOKEN = "run-token-hostile-hosts-456789"
APP = textwrap.dedent(f'''
    import pipelines_port as pp
    from tests.hostile_values import HOSTILE


    def agent(envelope):
        return HOSTILE[envelope.user_instruction].make()


    lenient = pp.DispatchApp(agent, token={TOKEN!r}, strict=False)
    strict = pp.DispatchApp(agent, token={TOKEN!r}, strict=True)
    lenient_wsgi = lenient.wsgi
    strict_wsgi = strict.wsgi
''')
HOSTS = {
    "uvicorn lenient": (lambda port: uvicorn_command("hostileapp:lenient", port), False),
    "uvicorn strict": (lambda port: uvicorn_command("hostileapp:strict", port), True),
    "gunicorn lenient": (lambda port: gunicorn_command("hostileapp:lenient_wsgi", port, threads=16), False),
    "gunicorn strict": (lambda port: gunicorn_command("hostileapp:strict_wsgi", port, threads=16), True),
}


@pytest.fixture(scope="module")
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        yield p


@pytest.fixture(scope="module", params=list(HOSTS))
def host(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[str, bool]]:
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "hostileapp.py").write_text(APP)
    command, strict = HOSTS[request.param]
    with started(request.param, command, cwd=folder, env=subprocess_env(folder)) as base:
        yield base, strict


def test_every_hostile_value_gets_a_json_reply_under_the_host(host: Tuple[str, bool], proxy: MockProxy) -> None:
    base, strict = host
    cases: List[str] = list(HOSTILE) * 4  # 168 dispatches at once

    def one(case: str) -> Reply:
        headers, body = dispatch_request(proxy.url, TOKEN, RUN_TOKEN, case)
        return http_call(base, "POST", "/dispatch", headers, body)

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        replies = list(pool.map(one, cases))
    wrong: Dict[str, str] = {}
    for case, reply in zip(cases, replies):
        expected = HOSTILE[case].strict_status if strict else 200
        try:
            body = json.loads(reply.body.decode("utf-8"))
        except ValueError:
            wrong[case] = f"{reply.status} not JSON: {reply.body[:80]!r}"
            continue
        if reply.status != expected or ESCAPED_SURROGATE.search(reply.body):
            wrong[case] = f"{reply.status} (expected {expected}): {str(body)[:120]}"
        elif reply.status == 500 and HOSTILE[case].where not in body["detail"]:
            wrong[case] = f"500 whose detail does not name {HOSTILE[case].where!r}: {body['detail'][:120]}"
        elif RUN_TOKEN in reply.body.decode("utf-8"):
            wrong[case] = "the run token in the reply"
    assert wrong == {}
