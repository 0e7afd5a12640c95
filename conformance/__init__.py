"""The pipelines_port kit: the conformance suite (vectors, a mock platform, checks for any port) and the dev tooling.

``python3 -m conformance COMMAND`` from a checkout; installed, this package is ``pipelines_port_kit`` and its
command is ``pipelines-port`` (``cli.py``).
"""
