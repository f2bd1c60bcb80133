"""The passes of a graph-defined kernel, printed by family; block.py orders them.

    elementwise.py  per-element passes (batched, vectorised) and `Store`
    rowwalk.py      row walks by a thread, a warp's lanes or the block, and `Walk`
    matmul.py       staging copies and tensor-core matmuls
    flash.py        online-softmax groups: the register path and the shared-memory passes
    reduce.py       reductions, moments, ACC_SUM accumulators
    saving.py       SAVE through the omap, partials with their maxima
    loading.py      ITER tiles: cp.async loads, pipeline stages, in-place PRE tiles

Why split: block.py was one class of 51 methods printing every family; each module here prints
one family from decisions made before, as frozen values (blockplan.BlockPlan, blockio.IoPlan),
as functions of the kernel being printed (`bk`, which holds them).
"""
