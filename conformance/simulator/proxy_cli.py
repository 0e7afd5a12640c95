"""``pipelines-port proxy``: one mock per-run proxy from the command line, and a dispatch to paste.

Serves a :class:`~conformance.harness.mock_proxy.MockProxy` on 127.0.0.1 until Ctrl-C, answering tool
calls as ``simulate`` would for one dataset row (its state and failure rules, optional fixtures), and
prints the curl command that dispatches a run to the user's agent through it.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from . import dataset as datasets
from . import engine
from ..harness.mock_proxy import RUNS_PATH, MockProxy, RecordedRequest
from ..kit import prog

__all__ = ["EXAMPLE_INSTRUCTION", "curl_dispatch", "main"]


EXAMPLE_INSTRUCTION = "What is the status of order 4521?"


def curl_dispatch(agent_url: str, proxy_url: str, run_token: str, instruction: str = EXAMPLE_INSTRUCTION) -> str:
    """A copy-paste curl command posting one dispatch as the platform does (§2), the agent token from $AGENT_TOKEN."""
    body = json.dumps({"run_id": 1, "task_id": 1, "input": {"task_id": 1, "user_instruction": instruction,
                                                              "input": {}},
                       "odyssey_proxy_url": proxy_url})
    return "\n".join([
        f"curl -sS {agent_url} \\",
        '  -H "Authorization: Bearer $AGENT_TOKEN" -H "Content-Type: application/json" \\',
        f'  -H "X-Pipelines-Run-Token: {run_token}" -H "X-Pipelines-Odyssey-Proxy-Url: {proxy_url}" \\',
        "  -d '" + body.replace("'", "'\\''") + "'",
    ])


def main(argv: Optional[List[str]] = None) -> int:
    """``pipelines-port proxy``: serve a mock per-run proxy until Ctrl-C, print a dispatch to paste into a shell."""
    parser = argparse.ArgumentParser(
        prog=prog("proxy"),
        description="A mock per-run proxy on 127.0.0.1 (CONTRACT §3) for trying an agent by hand: it prints its URL, "
                    "a run token and a curl dispatch to paste, then logs every tool call and trace event it gets.")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (default 8765; 0 for any)")
    parser.add_argument("--agent-url", default="http://127.0.0.1:8080/dispatch",
                        help="the agent's dispatch URL, for the printed curl command (default %(default)s)")
    parser.add_argument("--csv", metavar="FILE.csv", help="answer tools as the simulator does for a dataset row: "
                                                          "its state, failure rules (with --row)")
    parser.add_argument("--row", type=int, default=1, help="the data row of --csv to play (default 1)")
    parser.add_argument("--responses", metavar="FIXTURES.json", help="tool fixtures, as for simulate")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    backend, instruction = None, EXAMPLE_INSTRUCTION
    try:
        if args.csv or args.responses:
            fixtures = None
            if args.responses:
                with open(args.responses, encoding="utf-8") as f:
                    fixtures = engine.load_fixtures(json.load(f))
            state: Dict[str, Any] = {}
            rules: List[Any] = []
            if args.csv:
                data = datasets.load_dataset(args.csv)
                task = next((t for t in data.tasks if t.row == args.row), None)
                if task is None:
                    raise ValueError(f"{args.csv} has no valid data row {args.row} ({datasets.summary(data)})")
                state, rules, instruction = task.initial_state, task.failure_rules, task.user_instruction
                seed = engine.task_seed(task.row, task.user_instruction)
            else:
                seed = "proxy"
            backend = engine.Backend(state, rules, fixtures=fixtures, seed=seed)
    except (OSError, ValueError) as exc:
        print(f"{prog('proxy')}: {exc}", file=sys.stderr)
        return 2
    token = "run-token-" + secrets.token_hex(12)
    lock = threading.Lock()

    def answer(request: RecordedRequest) -> Dict[str, Any]:
        if backend is None:
            reply: Dict[str, Any] = {"response": {"tool": request.name, "args": request.json}}
        else:
            with lock:
                result = backend.call(request.name, request.json if isinstance(request.json, dict) else {})
            reply = {"response": result.response, "source": result.source,
                     "matched_rule_index": result.matched_rule_index}
        print(f"tool {request.name} {json.dumps(request.json, ensure_ascii=False)[:200]} -> "
              f"{json.dumps(reply['response'], ensure_ascii=False)[:200]}", flush=True)
        return reply

    try:
        proxy = MockProxy(tokens=[token], base_path=RUNS_PATH + "/1", port=args.port).start()
    except OSError as exc:
        print(f"{prog('proxy')}: cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    proxy.script("*", answer)
    print(f"mock proxy: {proxy.url}", flush=True)
    print(f"run token:  {token}   (a test token of this mock only)", flush=True)
    print("paste this into a shell where AGENT_TOKEN is your agent's token, with the agent serving:", flush=True)
    print(curl_dispatch(args.agent_url, proxy.url, token, instruction), flush=True)
    print("tool calls and trace events show up below; Ctrl-C stops", flush=True)
    seen = 0
    try:
        while True:
            time.sleep(0.2)
            requests = list(proxy.requests)
            for request in requests[seen:]:
                if request.kind == "traces":
                    print(f"trace {request.name} {json.dumps(request.json, ensure_ascii=False)[:200]}", flush=True)
                elif request.reply_status not in (200, None):
                    print(f"refused {request.method} {request.path} -> HTTP {request.reply_status}"
                          + (f" ({request.refusal})" if request.refusal else ""), flush=True)
            seen = len(requests)
    except KeyboardInterrupt:
        print(f"{prog('proxy')}: stopped", file=sys.stderr)
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
