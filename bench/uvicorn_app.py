"""pipelines_port's ASGI app under uvicorn, for bench_server.py's ``pipelines_port_uvicorn`` server.

    python -m uvicorn uvicorn_app:app --app-dir bench     (PYTHONPATH: the repository root)

``DispatchApp`` is itself an ASGI3 app: uvicorn's default interface detection takes it as one.
"""

import os

import pipelines_port as pp
from agents import three_calls, three_calls_async

# BENCH_AGENT_ASYNC=1: the ``async def`` agent, run on uvicorn's own loop.
app = pp.DispatchApp(three_calls_async if os.environ.get("BENCH_AGENT_ASYNC") == "1" else three_calls,
                     token_env="BENCH_AGENT_TOKEN")
