"""Talking to models: the scripted stand-in of the vendors' APIs (``scripted``), so agents and
every model-backed role run offline.

May import: the standard library and ``..kit`` only.
"""
