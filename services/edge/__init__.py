"""The HTTP edge: seed 002's REST + SSE API and the OpenAI-compatible API, a second door onto the
same Admission, Runs and Usage services the gRPC servicers call (DESIGN.md "Doors").

    request ─► app.py (Starlette routes) ─► seed_routes / openai_routes
                 │ body → bodies.py (pure: JSON → typed request, 400 naming the field)
                 │ messages → templates.py (the model registry's chat template)
                 ▼
       AdmissionService.submit · RunsService.get_run/stream/cancel · UsageQueryService.report
                 │ (in process: one run, one ledger row, one reservation, one event log)
                 ▼
       run events ─► sse.py / shapes.py (pure: SSE frames, OpenAI JSON) ─► client

Errors are domain errors (services/errors.py) mapped to HTTP once, in errors.py. A client that
drops an SSE stream only stops its reader: a run ends by Cancel, completion or its deadline.
Served by uvicorn (httptools parser, uvloop loop) inside the gateway process: server.py.
"""
