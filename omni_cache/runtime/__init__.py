"""The running pipeline, in layers, each importing only those below it (tests/test_architecture.py):

* ``orchestrator`` with ``stage_messages`` and ``replica_loss``: the top, which composes the rest
  and reacts to what the stages send and to replicas lost;
* ``routing``: which replica serves a request (prefix index, block hashes, affinity, policies);
* ``request_path``: a request from admission to its last event (the request table, results,
  output assembly, resumption, ends);
* ``supervision``: the stage processes (started here or placed on Ray, hang and connection watch,
  stopping), the links to them and the counters they report;
* ``metrics``: what ``GET /metrics`` exposes.
"""
