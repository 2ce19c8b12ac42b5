"""The serving layer: every load workload written once against an engine core.

An engine that can serve batches implements one interface, :class:`~qeval.serving.core.EngineCore`
(``engine.open_core(spec, clock)``): submit a request, advance one step and get the token
events back with their times, release a request, cache a shared prefix; it declares its slots,
its KV pool and whether qeval runs its steps (in process) or a server or a background thread
does. The workloads are modules here, one each, and never look at which engine they drive:

* :mod:`~qeval.serving.closed_loop`: N streams, each sending its next request when the last
  ended (the concurrency sweep, :func:`~qeval.serving.closed_loop.load_sweep`);
* :mod:`~qeval.serving.open_loop`: requests arriving on a schedule through the bounded waiting
  queue (the rate sweep, :func:`~qeval.serving.open_loop.rate_sweep`);
* :mod:`~qeval.serving.prefix`: a shared system prompt, its KV reused or prefilled per request;
* :mod:`~qeval.serving.interference`: one long prompt landing among decoding streams;
* :mod:`~qeval.serving.grid`: the context depth x concurrency grid;
* :mod:`~qeval.serving.burst`: N requests at once on an idle engine.

Modelled on vLLM's ``EngineCore`` (``add_request``, ``step``, ``abort_requests``: one core
under every frontend) and GuideLLM's ``BackendInterface`` (every profile runs unchanged on
every backend). Layer: below the engines (they implement the core and import its types),
above :mod:`qeval.measure` (the statistics).
"""
