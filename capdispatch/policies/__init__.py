"""What we prefer: YAML policies, layered. A policy never makes an impossible kernel run."""
from ..marked_yaml import MarkedList, MarkedMap
from .loader import (MIXED_GROUP, ON_UNSUPPORTED, VERIFY, Bucket, OpPreference, PolicyError, PolicyFile,
                     did_you_mean, from_dict, load_default, load_file, load_marked, parse)
from .stack import (BucketPreference, PolicyStack, Preference, Selection, SelectionError, Setting,
                    build, default_order, parse_selections)

__all__ = ["Bucket", "BucketPreference", "MIXED_GROUP", "MarkedList", "MarkedMap", "ON_UNSUPPORTED",
           "OpPreference", "PolicyError", "PolicyFile", "PolicyStack", "Preference", "Selection",
           "SelectionError", "Setting", "VERIFY", "build", "default_order", "did_you_mean", "from_dict",
           "load_default", "load_file", "load_marked", "parse", "parse_selections"]
