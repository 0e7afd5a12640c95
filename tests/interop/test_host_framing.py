"""The smuggling cases of tests/test_http_edges.py against the hosts that parse requests themselves.

Under uvicorn, hypercorn and gunicorn the host (h11 / httptools, hypercorn's h11, gunicorn's own parser)
reads the request head before the kit sees anything, so the kit's strict parser cannot help.  What matters
to a user is the same property: what was smuggled inside a request never runs the agent.  This test sends
every case to each host, asserts that nothing smuggled reached the proxy, and records each host's answer
in a table (printed with ``-s``; summarised in CONTRACT.md §7.1 kit-strict-request-head).

Skipped without uvicorn and gunicorn (hypercorn too, when missing).
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from typing import Dict, Iterator, List, Tuple

import pytest

from conformance.harness.mock_proxy import MockProxy
from tests.interop.hosts import gunicorn_command, hypercorn_command, started, subprocess_env, uvicorn_command
from tests.test_http_edges import AGENT_TOKEN, RUN_TOKEN, SMUGGLING, exchange, head, smuggled

pytest.importorskip("uvicorn", reason="needs uvicorn (tests/interop/requirements-hosts.txt)")
pytest.importorskip("gunicorn", reason="needs gunicorn (tests/interop/requirements-hosts.txt)")

APP = textwrap.dedent(f'''
    import pipelines_port as pp


    def agent(envelope):
        pp.proxy_call("get_order", {{"run_id": envelope.run_id}})
        return "ran"


    app = pp.DispatchApp(agent, token={AGENT_TOKEN!r})
    application = app.wsgi
''')

HOSTS = {"uvicorn": lambda port: uvicorn_command("framingapp:app", port),
         "gunicorn": lambda port: gunicorn_command("framingapp:application", port)}
if importlib.util.find_spec("hypercorn") is not None:
    HOSTS["hypercorn"] = lambda port: hypercorn_command("framingapp:app", port)


@pytest.fixture(scope="module")
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        yield p


@pytest.fixture(scope="module", params=list(HOSTS))
def host(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[str, int]]:
    folder = tmp_path_factory.mktemp("framing")
    (folder / "framingapp.py").write_text(APP)
    with started(request.param, HOSTS[request.param], cwd=folder, env=subprocess_env(folder)) as base:
        yield request.param, int(base.rsplit(":", 1)[1])


def test_nothing_smuggled_runs_under_the_host(host: Tuple[str, int], proxy: MockProxy) -> None:
    name, port = host
    before = len(proxy.calls())
    table: Dict[str, str] = {}
    for case, (fields, _status, _words) in SMUGGLING.items():
        inner = smuggled(proxy)
        lines = [f.replace(b"{n}", str(len(inner)).encode()) for f in fields]
        reply = exchange(port, head(b"POST /dispatch HTTP/1.1", *lines) + inner, wait_s=3)
        table[case] = f"{reply.status or 'no reply'}{' +close' if reply.closed else ''}"
    print(f"\n{name}: " + json.dumps(table, indent=1))
    leaked: List[str] = [json.dumps(c.json) for c in proxy.calls()[before:]]
    assert leaked == [], f"{name} ran a smuggled dispatch: {leaked}; answers: {table}"
