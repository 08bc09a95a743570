"""A random-weight DeepSeek-V4 checkpoint that SGLang's own loader loads: `plan(...)` says
every tensor (name, stored dtype, shape, how its values are drawn) and the config.json of
the cut model, without torch; `write(plan, out)` writes the Hugging Face folder, one shard
per layer, one tensor in memory at a time (torch needed).

Names, stored formats and shapes are the real DeepSeek-V4 checkpoint's (docs/checkpoint.md).
"""
from .config import NEEDED, checkpoint_config, source_config
from .plan import Draw, Plan, Shard, Tensor, plan
from .writer import Written, write

__all__ = ["NEEDED", "Draw", "Plan", "Shard", "Tensor", "Written", "checkpoint_config", "plan",
           "source_config", "write"]
