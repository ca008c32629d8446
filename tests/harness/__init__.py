"""Test harness: tiny models, a rank runner, real DeepSpeed and vLLM engines on CPU.

Tiny checkpoints (``tiny_models``, built by ``rollout_sync.tiny``)::

    def test_x(tiny_model):                      # session fixture from tests/conftest.py
        path = tiny_model("moe", seed=1)         # "dense" | "dense-tied" | "moe"; built once per session

Real DeepSpeed engines on CPU ranks (``deepspeed_engines``; mark the test ``@pytest.mark.deepspeed``)::

    def _check(ctx: DeepSpeedRank, arg):         # module level: ranks are spawned
        loss = train_step(ctx.engine, seed=0)    # ctx.engine, ctx.rank, ctx.world_size, ctx.group, ctx.spec
        return ...                               # must pickle

    spec = DeepSpeedSpec("dense", zero_stage=3, autotp_size=1, autoep_size=1, dtype="bf16")
    results = run_deepspeed(spec, tiny_model("dense"), _check, 2, arg, timeout=600)   # one per rank

Real vLLM CPU engines (``vllm_engines``; mark the test ``@pytest.mark.vllm``)::

    @pytest.fixture(scope="module")
    def engine(vllm_pool, tiny_model):
        return vllm_pool.get(shared_spec(tiny_model("dense"), 2))   # the test extension (vllm_ext.py)

    engine.generate_greedy(DEFAULT_PROMPTS, max_tokens=12)   # list of token-id lists
    engine.collective_rpc("rs_harness_ranks")                # one result per worker, in rank order
    vllm_pool.restore(engine)                                # after changing its weights
    vllm_pool.discard(engine)                                # after breaking it

A module that uses the pool is added to ``ENGINE_MODULE_ORDER`` in ``tests/conftest.py``.

``ranks.run_on_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, group, *args)`` on spawned gloo
ranks (see its module docstring).
"""
