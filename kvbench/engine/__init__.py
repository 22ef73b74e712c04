"""The engine: a KV cache that physically holds what a policy keeps, the attention that reads it, and the session
that drives a model through it. Its modules import one another in this order, each only those above it:

    joint       the cache a decode step of several sessions hands the model
    attention   the kvbench attention function: masks, statistics, the static step's attention
    rows        each row of a batch's accounts, as its own cache keeps them
    layer       one layer's slots (LayerKV)
    codecs      compressed fields of an entry;  storage  layers stored by a layout (quant, ...)
    accounting  what a cache measures: bytes held, peaked, read; evictions
    eviction    what a compression keeps, decided for any batch
    step        the decode step on static buffers: the slot each token takes
    cache       the cache (KVCache): sizing, compression, the static step's entry and accounts
    session     the calls every task makes (prefill, decode, step, score, fork); a joint step
    pool        a service's rows of static buffers, one batched decode step for every request in them

Below the engine: the policy contract (kvbench/policies/base.py), a run's settings, measurement; above it, what runs
sessions: generation and a shared prefill (kvbench/generation.py, kvbench/sharing.py), tasks, sweeps, the service,
calibration. The engine reads a policy through the object it is handed and imports no policy but the contract
(tests/test_imports.py holds it to that, and every module to no import cycle)."""
