"""Pure engine core: profiles, roofline cost model, paged KV pool, inflight-batching scheduler.

No I/O, no clock, no Triton: hosts (replica/ on the wall clock, sim/ on a virtual
clock) drive `EngineCore.step()` and drain the outputs it queues.
"""
