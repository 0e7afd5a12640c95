"""The platform from the kit: register an agent on Pipelines and run its dataset there, without the SDK.

``client`` is the platform's REST API on the runtime module's transport and retry loop (the API key from
``PIPELINES_API_KEY``, never shown); ``register`` creates or updates an agent (an HTTP endpoint, or code
uploaded to the sandbox); ``testrun`` is the ``test`` command: a test run from a checked dataset, followed
to its end, with the local judge's report, ``--min-pass-rate`` and JUnit.
May import: the runtime module, ``..simulator`` (the dataset check, the gate, reports), ``..kit``.
"""
