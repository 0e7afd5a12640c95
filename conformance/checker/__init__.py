"""The conformance checker: does an agent's endpoint keep the contract?

``check`` dispatches every case (``rules.json``: CONTRACT.md's rules as data; ``vectors/``: the
language-neutral contract cases every port reads) to an endpoint through the harness, and reports
each rule by tier.  ``agent`` is the scripted agent a port serves to be checked.
May import: the runtime module, ``..harness``, ``..kit``.  Nothing of the simulator, models or project.
"""
