"""The engine: a model, the KV cache that physically holds what a policy keeps, the attention that reads it, the
session that drives the model through it, and what every task needs of a session. Its modules import one another
in this order, each only those above it:

    joint          the cache a decode step of several sessions hands the model
    received_kernel  a prompt's H2O statistics on a GPU, in Triton (attention imports it for CUDA tensors only)
    attention      the kvbench attention function: masks, statistics, the static step's attention
    stats          a cache's counters, as one record
    row_accounts   each row of a batch's accounts, as its own cache keeps them
    layer          one layer's slots (LayerKV)
    accounting     what a cache measures: bytes held, peaked, read; evictions
    eviction       what a compression keeps, decided for any batch
    instruments    stopwatch, memory peaks (allocator, NVML, process), tracing
    step           the decode step on static buffers: the slot each token takes
    cache          the cache (KVCache): sizing, compression, the static step's entry and accounts
    codecs         compressed fields of an entry;  storage  layers stored by a layout (quant, ...)
    paging         a layer's slots in pages, as a paged cache lays them out (Quest)
    models         loading a model (hub, folder, GGUF, embedded, random:) and what the engine reads of it
    estimate       what a cache costs before running: bytes from the model's shape, a sweep's time
    fidelity       a full-cache session in lockstep with a policy's, compared step by step
    segments       a prompt's units a task names, and what the cache kept of each
    measurements   a record's speed, byte and memory columns from what a session measured
    settings       a run's settings and the budget they resolve to
    session        the calls every task makes (prefill, decode, step, score, fork); a joint step
    generation     one prompt (or a left-padded batch) and its greedy answer
    sharing        a sweep's shared prefill: one forward, every cell's statistics
    pool           a service's rows of static buffers, one batched decode step for every request in them

Below the engine: the policy contract (policies/base.py, budgets.py, reference.py, full.py). Above it: what it
runs (policies, tasks, calibration), the service, the sweep. The engine reads a policy through the object it is
handed and imports no policy but the contract and `full`, the reference every run is compared with
(tests/test_imports.py holds every module to its stage)."""
