"""Code mode in a real Jupyter kernel, called from cells exactly as the platform's sandbox calls it (§5).

A real IPython kernel (ipykernel, driven by jupyter_client) runs in a working directory holding what a user
uploads: ``pipelines_port.py``, every template and ``tools_schema.json``.  Cells import a template and call
``run(task_input, proxy_url=..., run_token=...)`` against a MockProxy and the local fake model APIs in this
process: plain cells, top-level ``await`` cells, many runs in a row, concurrent runs on threads, an agent
whose exception carries the token, one that never ends (the run timeout, a kernel interrupt), and the
environment-only path.  Every iopub message the kernel sends (stdout, stderr, results, tracebacks) is kept
and must never show a run token.  Skips when ipykernel or jupyter_client is missing.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional

import pytest

from conformance.harness.mock_proxy import MockProxy
from tests.fake_model_apis import FakeAnthropicAPI, FakeChatAPI, FakeResponsesAPI, Turn
from tests.interop.hosts import ROOT

jupyter_client = pytest.importorskip("jupyter_client", reason="the kernel tests need jupyter_client")
pytest.importorskip("ipykernel", reason="the kernel tests need ipykernel")

CELL_S = 60.0  # one cell's time limit
TASK = {"user_instruction": "Refund order #4521 if it shipped more than 30 days ago.",
        "input": {"customer_id": "cust_99"}, "task_id": 42}
LOOP_TEMPLATES = {"openai_responses": FakeResponsesAPI, "openai_chat": FakeChatAPI,
                  "anthropic_messages": FakeAnthropicAPI}

# Agents a user might upload, written into the kernel's working directory next to the module.
LEAKY = '''
import pipelines_port as pp

class ClientError(Exception):
    def __init__(self, token):
        super().__init__("request failed")
        self.request = type("Request", (), {"headers": {"Authorization": "Bearer " + token}})()
    def __str__(self):
        return "request failed, headers: %s" % (self.request.headers,)

def agent(envelope):
    try:
        raise ClientError(envelope.run_token)
    except ClientError as exc:
        raise ValueError("request failed, headers: Authorization: Bearer " + envelope.run_token) from exc

run = pp.code_mode(agent)
'''
LOOPING = '''
import time
import pipelines_port as pp

def agent(envelope):
    while True:
        pp.proxy_call("poll", {})
        time.sleep(0.05)

run = pp.code_mode(agent)
run_briefly = pp.code_mode(agent, run_timeout_s=1)
'''


class Cell(NamedTuple):
    status: str  # "ok" | "error"
    stdout: str
    error: Optional[Dict[str, Any]]  # ename, evalue, traceback


class Kernel:
    """One IPython kernel in ``cwd``; every iopub message it sends is kept in ``messages``."""

    def __init__(self, cwd: Path, env: Dict[str, str]) -> None:
        self.manager = jupyter_client.KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(cwd), env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=CELL_S)
        self.messages: List[Dict[str, Any]] = []

    def run(self, code: str, timeout: float = CELL_S) -> Cell:
        msg_id = self.client.execute(textwrap.dedent(code))
        stdout: List[str] = []
        error: Optional[Dict[str, Any]] = None
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the cell did not finish within {timeout} s: {code[:200]}") from None
            self.messages.append(message)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream" and content["name"] == "stdout":
                stdout.append(content["text"])
            elif kind == "error":
                error = content
            elif kind == "status" and content["execution_state"] == "idle":
                break
        return Cell("error" if error else "ok", "".join(stdout), error)

    def value(self, code: str, timeout: float = CELL_S) -> Any:
        """Run ``code`` whose last line prints one JSON value; that value."""
        cell = self.run(code, timeout)
        assert cell.status == "ok", cell.error and "\n".join(cell.error["traceback"])
        return json.loads(cell.stdout.strip().splitlines()[-1])

    def interrupt_during(self, code: str, after_s: float) -> Cell:
        msg_id = self.client.execute(textwrap.dedent(code))
        time.sleep(after_s)
        self.manager.interrupt_kernel()
        error = None
        deadline = time.monotonic() + CELL_S
        while True:
            message = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            self.messages.append(message)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "error":
                error = message["content"]
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                return Cell("error" if error else "ok", "", error)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


class World(NamedTuple):
    kernel: Kernel
    proxy: MockProxy
    apis: Dict[str, Any]
    workdir: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("sandbox")
    shutil.copy(ROOT / "pipelines_port.py", workdir)
    for template in (ROOT / "templates").iterdir():
        if template.suffix in (".py", ".json"):
            shutil.copy(template, workdir)
    (workdir / "leaky.py").write_text(LEAKY)
    (workdir / "looping.py").write_text(LOOPING)
    apis = {name: fake().start() for name, fake in LOOP_TEMPLATES.items()}
    foreign = ("PIPELINES_", "_PIPELINES_", "OPENAI_", "ANTHROPIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(foreign) and k not in ("PYTHONPATH", "AGENT_TOKEN")}
    # The kernel's PYTHONPATH is its working directory only: the module it imports is the uploaded copy.
    env.update(OPENAI_MODEL="test-model-7", ANTHROPIC_MODEL="test-model-7", PYTHONUNBUFFERED="1")
    env.update(ANTHROPIC_BASE_URL=apis["anthropic_messages"].base_url,
               ANTHROPIC_API_KEY=apis["anthropic_messages"].api_key)
    env["OPENAI_API_KEY"] = apis["openai_chat"].api_key
    assert apis["openai_responses"].api_key == apis["openai_chat"].api_key
    with MockProxy() as proxy:
        kernel = Kernel(workdir, env)
        try:
            kernel.run("import json, os, threading, asyncio")
            yield World(kernel, proxy, apis, workdir)
        finally:
            kernel.close()
            for api in apis.values():
                api.stop()


def new_run(world: World) -> Any:
    return world.proxy.new_run()


def hand_over(world: World, run: Any) -> None:
    """Put the run's proxy URL and token into the kernel as RUN_URL / RUN_TOKEN, in a cell of their own.

    Only that cell's own source shows them (``execute_input``, the caller's text echoed back); the cells that
    call ``run()`` name them, so a traceback's source lines cannot show a token the kit did not.
    """
    assert world.kernel.run(f"RUN_URL, RUN_TOKEN = {run.url!r}, {run.token!r}").status == "ok"


def call_cell(module: str) -> str:
    return (f"from {module} import run\nresult = run({json.dumps(TASK)}, proxy_url=RUN_URL, run_token=RUN_TOKEN)\n"
            "print(json.dumps(result))")


def agent_threads_left(world: World) -> int:
    """The kernel's ``pipelines-agent`` threads still alive after up to 5 s."""
    return int(world.kernel.value("""
        import time
        deadline = time.monotonic() + 5
        while any(t.name == "pipelines-agent" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(json.dumps(sum(t.name == "pipelines-agent" for t in threading.enumerate())))
    """))


def tokens_in_iopub(world: World) -> List[str]:
    """Every run token an iopub message showed: stdout, stderr, results, tracebacks (inputs echoed aside)."""
    text = json.dumps([m["content"] for m in world.kernel.messages if m["msg_type"] != "execute_input"])
    return [run.token for run in world.proxy.runs if run.token in text]


# -- the cases -----------------------------------------------------------------------------------------------


def test_the_kernel_runs_the_uploaded_module_with_its_loop_running(world: World) -> None:
    facts = world.kernel.value("""
        import pipelines_port
        loop = asyncio.get_event_loop()
        print(json.dumps([pipelines_port.__file__, loop.is_running(), os.getcwd()]))
    """)
    assert Path(facts[0]).parent == world.workdir and Path(facts[2]) == world.workdir
    assert facts[1] is True  # the kernel's loop runs on the cell's thread: asyncio.run would fail here


def test_the_minimal_template_from_a_plain_cell(world: World) -> None:
    run = new_run(world)
    hand_over(world, run)
    result = world.kernel.value(call_cell("minimal"))
    assert result["final_response"] and run.requests and all(r.run_token == run.token for r in run.requests)


@pytest.mark.parametrize("template", sorted(LOOP_TEMPLATES))
def test_each_model_api_template_runs_its_agent_loop_in_the_kernel(world: World, template: str) -> None:
    api = world.apis[template]
    api.script([Turn(tool_calls=[("get_order", {"order_id": "4521"})]), Turn(text="Order 4521 is refunded.")])
    base = "OPENAI_BASE_URL" if template.startswith("openai") else "ANTHROPIC_BASE_URL"
    world.kernel.run(f"os.environ[{base!r}] = {api.base_url!r}")
    run = new_run(world)
    hand_over(world, run)
    result = world.kernel.value(call_cell(template))
    assert result["final_response"] == "Order 4521 is refunded."
    tools = [r for r in run.requests if r.kind == "tools"]  # the templates post trace events too
    assert [r.name for r in tools] == ["get_order"] and tools[0].json == {"order_id": "4521"}
    assert all(r.run_token == run.token for r in run.requests)


def test_the_async_framework_template_from_a_top_level_await_cell(world: World) -> None:
    run = new_run(world)
    hand_over(world, run)
    cell = "await asyncio.sleep(0)\n" + call_cell("async_framework")
    result = world.kernel.value(cell)
    assert result["final_response"] and all(r.run_token == run.token for r in run.requests)


def test_twenty_runs_in_a_row(world: World) -> None:
    runs = [new_run(world) for _ in range(20)]
    cell = "from minimal import run\nout = []\n" + "".join(
        f"out.append(run({json.dumps(TASK)}, proxy_url={r.url!r}, run_token={r.token!r})['final_response'])\n"
        for r in runs) + "print(json.dumps(out))"
    assert len(world.kernel.value(cell)) == 20
    assert all(r.requests and all(q.run_token == r.token for q in r.requests) for r in runs)


def test_ten_concurrent_runs_on_threads_never_cross_tokens(world: World) -> None:
    runs = [new_run(world) for _ in range(10)]
    for index, r in enumerate(runs):
        r.script("*", lambda request, index=index: {"response": {"run": index}})
    assert world.kernel.run(f"PAIRS = {json.dumps([[r.url, r.token] for r in runs])}").status == "ok"
    cell = """
        import pipelines_port as pp
        from concurrent.futures import ThreadPoolExecutor

        def agent(envelope):
            return json.dumps(pp.proxy_call("whoami", {}))
        run = pp.code_mode(agent)
        with ThreadPoolExecutor(10) as pool:
            out = list(pool.map(lambda p: run({"user_instruction": "who"}, proxy_url=p[0], run_token=p[1]), PAIRS))
        print(json.dumps([json.loads(o["final_response"]) for o in out]))
    """
    assert world.kernel.value(cell) == [{"run": i} for i in range(10)]
    for r in runs:
        (request,) = r.requests
        assert request.run_token == r.token


def test_an_agent_exception_carrying_the_token_shows_it_nowhere_on_the_kernels_output(world: World) -> None:
    run = new_run(world)
    hand_over(world, run)
    cell = world.kernel.run(call_cell("leaky"))
    assert cell.status == "error" and cell.error is not None and cell.error["ename"] == "AgentError"
    traceback_text = "\n".join(cell.error["traceback"])
    # The whole chain is printed (the cause's frames and type are there), the token nowhere.
    assert "ValueError" in traceback_text and "ClientError" in traceback_text and "[redacted]" in traceback_text
    assert run.token not in traceback_text
    assert tokens_in_iopub(world) == []


def test_a_run_that_overruns_its_timeout_raises_and_leaves_no_thread_behind(world: World) -> None:
    run = new_run(world)
    hand_over(world, run)
    cell = world.kernel.run("from looping import run_briefly\nrun_briefly({}, proxy_url=RUN_URL, run_token=RUN_TOKEN)")
    assert cell.error is not None and cell.error["ename"] == "RunTimeoutError"
    assert "run_timeout_s=1 s" in cell.error["evalue"]
    ended = time.monotonic()
    left = agent_threads_left(world)
    assert left == 0 and run.requests
    assert [r for r in run.requests if r.time > ended] == []


def test_an_interrupted_run_leaves_no_thread_behind(world: World) -> None:
    run = new_run(world)
    hand_over(world, run)
    cell = world.kernel.interrupt_during("from looping import run\nrun({}, proxy_url=RUN_URL, run_token=RUN_TOKEN)",
                                         after_s=1.0)
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt"
    left = agent_threads_left(world)
    assert left == 0 and run.requests


def test_the_environment_path_run_and_a_plain_cell_call(world: World) -> None:
    run = new_run(world)
    task = json.dumps({"user_instruction": "hi from the environment", "input": {}, "task_id": 77})
    result = world.kernel.value(f"""
        os.environ.update({{"PIPELINES_ODYSSEY_PROXY_URL": {run.url!r}, "PIPELINES_RUN_TOKEN": {run.token!r},
                            "PIPELINES_TASK_ID": "77", "_PIPELINES_TASK_INPUT_JSON": {task!r}}})
        import pipelines_port as pp
        from minimal import run
        envelope = pp.Envelope.from_env()
        direct = pp.proxy_call("get_order", {{"order_id": "1"}})
        answer = run()
        for name in ("PIPELINES_ODYSSEY_PROXY_URL", "PIPELINES_RUN_TOKEN", "PIPELINES_TASK_ID",
                     "_PIPELINES_TASK_INPUT_JSON"):
            del os.environ[name]
        print(json.dumps([envelope.task_id, direct, bool(answer["final_response"])]))
    """)
    assert result == [77, {"tool": "get_order", "args": {"order_id": "1"}}, True]
    assert len(run.requests) >= 2 and all(r.run_token == run.token for r in run.requests)


def test_no_iopub_message_ever_showed_a_run_token(world: World) -> None:
    """Runs last in this module: the whole kernel session, every cell above, scanned once more."""
    assert len(world.kernel.messages) > 50
    assert tokens_in_iopub(world) == []
