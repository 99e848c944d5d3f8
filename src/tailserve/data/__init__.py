"""Plain data handed between layers: what a step produced, what the engine looks like now,
what a finished request was.

The bottom layer next to ``request.py``: these modules import only ``request``,
``sampling_params`` and each other, so the scheduler, the model runner, the engine, ``obs/``
and the server can all use them without importing one another (``tests/test_layering.py``).
Nothing is re-exported here: import each name from its own module.
"""
