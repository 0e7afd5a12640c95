"""The platform's two ends, played locally: the mock per-run proxy an agent calls back
(``mock_proxy``) and the dispatcher that sends an endpoint its runs (``dispatcher``).

Shared by the checker and the simulator.  May import: the standard library and ``..kit`` only.
"""
