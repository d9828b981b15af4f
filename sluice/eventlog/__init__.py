"""The run event log: sequenced stream events per run (DESIGN.md "Event log and resume").

`events` is the pure core (building, coalescing and de-duplicating events);
`interface` is the Protocol every backend implements; `kafka` is the Apache
Kafka adapter, the only module here that does I/O.
"""
