"""A service under load: requests arrive, wait for room in a pool of KV memory, prefill, join the running batch and
leave it at their end, on the engine's own sessions.

The scheduler (kvbench/serving/scheduler.py) is first come, first served by default, one prefill at a time: it admits
the request at the head of the queue when the pool has room for it and runs its prefill in a session of its own
(one row, so its policy compresses the prompt as it does alone). A `full` prefill runs whole between two decode steps
(prefill-then-join, as vLLM's scheduler without chunked prefill); a `chunked` one feeds one chunk between two decode
steps (as vLLM's and Sarathi's chunked prefill), so a long prompt stalls the running requests a chunk at a time.

The pool is rows of static buffers (kvbench/engine/pool.py), as many as its bytes hold at the width a request of the
policy needs (`need_tokens` sizes the widest); a request is admitted while a row is free, joins a row after its
prefill, and every decode step is one batched forward over the rows in use. Where the requests' rows cannot share
each layer's bound (`pool_plan` says why), each keeps its own cache and they decode in a joint step
(kvbench/engine/joint.py); the pool is then counted in bytes: room is judged before the prefill from the request's
lengths (`cache_need`: the prompt's full cache while a policy compresses it, then what the policy keeps plus the
output), beside what the admitted requests hold or will hold, and checked after every step against the bytes the
caches really hold: a pool outgrown by decoding preempts the newest running request, which goes back to the front of
the queue and is recomputed from its prompt (its answer is its run alone's again; vLLM re-prefills the prompt with
the output so far, which a prefill-time policy would then compress as prompt). A request waits at most `timeout_s` in
the queue, the queue holds at most `max_queue`, and nothing runs past `horizon_s`: each request offered ends finished
or rejected, with the reason; one the horizon came before (not arrived yet, or not sent yet by its closed-loop user)
was never offered.

Time is the wall clock from when the service is set up, except that an idle service skips to the next arrival
(nothing runs meanwhile, so no measurement changes). Setting up is a server's start-up, off the clock: the policy is
prepared once (its calibration artifacts read, the model's digest hashed, RazorAttention's calibration run), and what
that read or computed is kept per model, so each request's session finds it there and its times are its own work.

The folder, in the order its modules import each other: `requests` (the load, a request and what happened to it,
what was served), `arrivals` (Poisson arrivals, a trace file), `sizing` (what a request's cache holds, the pool's
bytes), `scheduler` (which request is admitted, which is preempted), `service` (the loop), `metrics` (the cell's
service columns). It imports the engine and the models, and nothing of the sweep or the analysis after it.
"""

from kvbench.serving.arrivals import TraceRequest, poisson_arrivals, read_trace
from kvbench.serving.metrics import percentiles, service_metrics
from kvbench.serving.requests import REJECTED, Load, Request, Served
from kvbench.serving.scheduler import Admission, FirstComeFirstServed, Scheduler
from kvbench.serving.service import Service
from kvbench.serving.sizing import Need, cache_need, need_tokens, pool_bytes, pool_spec

__all__ = ["REJECTED", "Admission", "FirstComeFirstServed", "Load", "Need", "Request", "Scheduler", "Served", "Service",
           "TraceRequest", "cache_need", "need_tokens", "percentiles", "poisson_arrivals", "pool_bytes", "pool_spec",
           "read_trace", "service_metrics"]
