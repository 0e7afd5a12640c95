"""A user's project: scaffold it from a template (``init``), check its setup (``doctor``), and
run the bundled sample against it (``demo``).

May import: the runtime module, ``..simulator``, ``..kit``.  The top of the import graph, with ``..cli``.
"""
