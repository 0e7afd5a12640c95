"""The local platform: run a task-seeding dataset against an agent as the platform would.

``dataset`` reads and checks the CSV; ``engine`` is the simulated backend (failure rules, the ledger,
fixtures); ``simulate`` is the run loop (one mock proxy per run, HTTP or code mode, K trials of each row);
``judge`` grades the runs and ``gate`` holds the verdicts to a CI gate; ``report`` renders text and HTML;
``shards`` splits a run and merges the JSONL results; ``compare`` holds a report to a baseline.
May import: the runtime module, ``..harness``, ``..models``, ``..kit``.  Nothing of the checker or project.
"""
