"""Blend mode in the fast engine (issue #28 §3; docs/ARCHITECTURE.md, "Blend mode"): the only producer of row plans
(chunkwise/engine/row_plan.py) for prefills that reuse chunks' own K/V at new positions, and the owner of their
`chunk_reuse` report. The model, the runner and the CUDA graphs apply row plans without importing this package.

- `policy`: how many candidates each policy computes, at which check layers.
- `planning`: a blended prefill's candidates resolved against the prefix cache (`plan_blend`), as a `RowPlan`.
- `report`: its ChunkReuse per piece, from the rows its step computed at the last layer.
- `blender`: the per-request records (`Blender`): the scheduler's row planner and the engine's report source.
"""
from chunkwise.engine.blend.blender import Blender
from chunkwise.engine.blend.planning import BlendJob, layer_rows, plan_blend
from chunkwise.engine.blend.policy import (MAX_CHECK_LAYERS, check_layers, check_ratios, computed_candidates,
                                           kept_counts, num_kept)
from chunkwise.engine.blend.report import blend_report

__all__ = ["Blender", "BlendJob", "MAX_CHECK_LAYERS", "blend_report", "check_layers", "check_ratios",
           "computed_candidates", "kept_counts", "layer_rows", "num_kept", "plan_blend"]
