"""pipelines_port's ASGI app under uvicorn, for bench_server.py's ``pipelines_port_uvicorn`` server.

    python -m uvicorn uvicorn_app:app --app-dir bench     (PYTHONPATH: the repository root)

``DispatchApp`` is itself an ASGI3 app: uvicorn's default interface detection takes it as one.
"""

import pipelines_port as pp
from agents import three_calls

app = pp.DispatchApp(three_calls, token_env="BENCH_AGENT_TOKEN")
