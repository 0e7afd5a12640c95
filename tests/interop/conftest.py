"""The interop tier's shared fixtures: the real OpenAI-compatible model server (tests/interop/model_server.py),
one per session for every test that asks for ``openai_compatible_server``."""

from tests.interop.model_server import openai_compatible_server  # noqa: F401  (a fixture, found by name)
