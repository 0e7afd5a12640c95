"""pipelines_port's WSGI app under gunicorn, for bench_fanout.py's ``pipelines_port_gunicorn`` server.

    gunicorn wsgi_app:application --chdir bench -k gthread --threads N     (PYTHONPATH: the repository root)
"""

import pipelines_port as pp
from agents import three_calls

application = pp.DispatchApp(three_calls, token_env="BENCH_AGENT_TOKEN").wsgi
