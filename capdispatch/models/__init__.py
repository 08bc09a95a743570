"""Model shapes: a DeepSeek-V4-class model's facts and each rank's share under a layout.

`load_model(name_or_path)` reads a built-in (builtin.yaml, the published config facts) or a
Hugging Face config.json; `ModelShape.for_rank(tp, ep, dp_attention)` gives one rank's
shapes the way SGLang 0.5.23 shards DeepSeek-V4, or a ModelError naming the numbers and the
layouts that would work; `ModelShape.calls()` what the model calls of capdispatch's ops
(calls.yaml: which ops, on which layers, at what size per phase). Pure Python: no torch, nothing read at import.
"""
from .calls import ModelCalls, OpCalls, model_calls
from .errors import ModelError
from .loader import builtin_entry, builtin_names, load_model
from .shape import ModelShape, TensorFormat
from .sharding import Layout, RankShape
from .sharding import check as check_layout

__all__ = ["Layout", "ModelCalls", "ModelError", "ModelShape", "OpCalls", "model_calls", "RankShape", "TensorFormat", "builtin_entry",
           "builtin_names", "check_layout", "load_model"]
