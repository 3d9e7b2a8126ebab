"""What the tests share, importable as ``support.*`` (pyproject: pytest's pythonpath is tests/).

- ``support.states``: ``assert_same_state``, the one bit-exact comparison of a state with the
  state it came back as; ``training_states``, consecutive checkpoints of a real AdamW run.
- ``support.bodies``: safetensors bodies built by hand (``framed``, ``valid_body``,
  ``client_body``), sent over raw HTTP (``partial_upload``, ``chunked_upload``,
  ``read_response``, ``wait_consumed``), and what a rejected one must leave
  (``assert_error``, ``assert_nothing_stored``).
- ``support.waiting``: ``wait_until``, ``eventually``, ``poll``: waits on an observable
  condition, never a fixed sleep.
- ``support.serviceproc``: ``Service``, the real service in a child process on a free port;
  ``wait_idle`` (no background maintenance); ``maintenance_runs`` (its background passes,
  by task and outcome, from /metrics); ``free_port``.
- ``support.pg``: a throwaway database on the real PostgreSQL server.
- ``support.s3server``: moto's S3 server on a free port, dummy credentials, and
  ``s3_store`` (the store a service's ``CKPTSTORE_*`` S3 settings name).

Fixtures live in the conftest.py files: tests/conftest.py (databases, services, the S3
server), tests/api/conftest.py (httpx clients), tests/integration/conftest.py (the
production backends: PostgreSQL + S3).
"""
