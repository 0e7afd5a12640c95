"""The pipelines_port kit: the conformance checker, the local platform, and the dev tooling.

``python3 -m conformance COMMAND`` from a checkout; installed, this package is ``pipelines_port_kit`` and its
command is ``pipelines-port`` (``cli.py``).  Sub-packages by job, each importing only those below it:

    cli.py       the command table (imports each command's module when it runs)
    project/     init, doctor, demo: a user's project            -> simulator, kit
    platform_api/ register, test: the platform's REST API        -> simulator, kit
    checker/     check, rules, vectors, the conformance agent    -> harness, kit
    simulator/   dataset, engine, the run loop, sessions, the judge,
                 reports, shards, the gate                       -> harness, models, kit
    harness/     the mock per-run proxy and the dispatcher       -> kit
    models/      the model client, its cache, the scripted stand-in -> kit
    kit.py       where the kit is and how its commands are spelled (imports nothing of the kit)
    ports/       the TypeScript, Go and Rust reference ports (not Python, not installed)
"""
